import torch

from lightning_remat.meter import peak_bytes


def test_known_allocation_reads_right_on_cpu():
    def work():
        t = torch.ones(64 * 1024 * 1024)  # 256 MiB
        del t

    got = peak_bytes(work)
    assert abs(got - 256 * 2**20) < 8 * 2**20, got


def test_peak_is_the_maximum_not_the_sum():
    def work():
        for _ in range(3):
            t = torch.ones(16 * 1024 * 1024)  # 64 MiB, freed each round
            del t

    got = peak_bytes(work)
    assert 60 * 2**20 < got < 80 * 2**20, got


def test_nothing_allocated_reads_near_zero():
    assert peak_bytes(lambda: None) < 2 * 2**20


def test_release_lets_the_heap_serve_and_the_meter_fixes_it_again():
    from lightning_remat import meter as memory

    memory.release_mmap_threshold()
    assert not memory._threshold_set
    for _ in range(3):  # buffers now come from (and go back to) glibc's heap
        del [torch.ones(256 * 1024) for _ in range(16)][:]

    def work():
        t = torch.ones(32 * 1024 * 1024)  # 128 MiB
        del t

    got = peak_bytes(work)
    assert memory._threshold_set
    assert abs(got - 128 * 2**20) < 8 * 2**20, got
