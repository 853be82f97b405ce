import torch

from lightning_remat.measure.peak import peak_bytes


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


def test_an_ops_internal_buffers_count():
    """A convolution through im2col (oneDNN off) allocates its column buffer inside the op:
    never a tensor the caller sees, but memory the step holds."""
    from lightning_remat.measure.storage import StorageMeter

    conv = torch.nn.Conv2d(16, 16, 3, padding=1)
    x = torch.randn(2, 16, 64, 64)
    output = 2 * 16 * 64 * 64 * 4
    one_image_columns = 16 * 9 * 64 * 64 * 4
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
        got = peak_bytes(lambda: conv(x))
        with StorageMeter() as storage:
            conv(x)
    assert got >= output + one_image_columns, got
    assert storage.peak == output  # what dispatch sees: the output alone


def test_the_profile_charges_an_ops_internal_buffers_to_it_as_workspace():
    from lightning_remat.graph.profile import profile_module

    model = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU())
    x = torch.randn(2, 16, 64, 64)
    with torch.backends.mkldnn.flags(enabled=False):
        graph = profile_module(model, x, repeats=1)
    conv = graph.nodes[0]
    assert conv.ws_fwd >= 16 * 9 * 64 * 64 * 4, conv  # im2col's columns, one image at least
    assert conv.ws_bwd >= 16 * 9 * 64 * 64 * 4, conv


def test_a_running_profiler_leaves_the_storage_meter_after_one_warning():
    import warnings

    from lightning_remat.measure import peak as measured

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        measured._warned_busy = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = peak_bytes(lambda: torch.ones(1024 * 1024))
            peak_bytes(lambda: None)
    assert [str(w.message)[:40] for w in caught] == ["another torch.profiler is running, so th"]
    assert got == 4 * 1024 * 1024


def test_a_log_inside_a_log_reads_both():
    """A measurement inside a metered one (the planner profiling inside a training step that
    the memory timeline meters): both read every allocation, none of it through the storage
    meter's fallback."""
    import warnings

    from lightning_remat.measure.allocations import AllocationLog, paused
    from lightning_remat.measure.peak import step_meter

    mib = 2**20
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback's warning
        with step_meter() as outer:
            kept = torch.ones(16 * mib // 4)
            with step_meter() as inner:
                torch.ones(64 * mib // 4)
            with paused():  # left out of the outer log
                torch.ones(128 * mib // 4)
            del kept
    assert isinstance(outer, AllocationLog) and isinstance(inner, AllocationLog)
    assert abs(inner.peak - 64 * mib) < mib, inner.peak
    assert abs(outer.peak - 80 * mib) < mib, outer.peak
