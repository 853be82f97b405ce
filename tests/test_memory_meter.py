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
