"""The CUDA paths' logic, run on the CPU: through the device layer's stand-in
(lightning_remat.streams.SimulatedStreams) or with torch.cuda's counters replaced by fakes
that record what was read, and fail on any device synchronisation."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger
from lightning_remat.measure import peak as measured
from lightning_remat.streams import SimulatedStreams, streams_for


class FakeCudaCounters:
    """torch.cuda's allocator counters as the caching allocator would report them."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.allocated = 1000
        self.peak = 5000

    def install(self, monkeypatch) -> None:
        def fail(*_a, **_k):
            raise AssertionError("a device synchronisation")

        monkeypatch.setattr(torch.cuda, "synchronize", fail)
        monkeypatch.setattr(measured, "is_cuda", lambda device: True)
        for name, value in (("memory_allocated", lambda: self.allocated), ("max_memory_allocated", lambda: self.peak),
                            ("memory_reserved", lambda: 8000), ("reset_peak_memory_stats", lambda: None)):
            monkeypatch.setattr(torch.cuda, name, self._reader(name, value))

    def _reader(self, name, value):
        def read(device=None):
            self.reads.append(name)
            return value()
        return read


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def add_figure(self, *a, **k):
        pass


def test_the_memory_dashboard_reads_cuda_counters_without_syncing_and_only_on_logging_steps(monkeypatch):
    counters = FakeCudaCounters()
    counters.install(monkeypatch)
    writer = FakeWriter()
    trainer = SimpleNamespace(global_step=0, loggers=[SimpleNamespace(experiment=writer)],
                              strategy=SimpleNamespace(planner=None), is_global_zero=True)
    module = SimpleNamespace(device=torch.device("cuda", 0))
    callback = MemoryTimelineLogger(log_every_n_steps=3)
    for step in range(6):
        trainer.global_step = step
        callback.on_train_batch_start(trainer, module, None, step)
        callback.on_train_batch_end(trainer, module, None, None, step)
    peaks = [(value, step) for tag, value, step in writer.scalars if tag == "remat/peak_MiB"]
    assert peaks == [(4000 / 2**20, 0), (4000 / 2**20, 3)]  # peak above the step's base, steps 0 and 3 only
    assert counters.reads.count("max_memory_allocated") == 2
    assert counters.reads.count("reset_peak_memory_stats") == 2


def test_the_stand_in_completes_copies_in_issue_order_and_counts_bytes_in_flight():
    streams = SimulatedStreams(latency=2)
    src = [torch.full((8,), float(i)) for i in range(4)]
    dst = [torch.empty(8) for _ in range(4)]
    events = [streams.copy_to_host(s, d) for s, d in zip(src, dst)]
    assert [streams.done(e) for e in events] == [True, True, False, False]
    assert streams.bytes_in_flight == 2 * 32 and streams.max_bytes_in_flight == 3 * 32
    streams.compute_waits(events[3])  # waiting for the last completes the ones before it too
    assert all(streams.done(e) for e in events)
    assert [d[0].item() for d in dst] == [0.0, 1.0, 2.0, 3.0]
    assert ("wait", 32) in streams.log


def test_a_fetched_tensor_reads_nan_until_the_compute_stream_waits_for_it():
    streams = SimulatedStreams(latency=None)
    out, event = streams.copy_to_device(torch.ones(4))
    assert torch.isnan(out).all()
    streams.compute_waits(event)
    assert torch.equal(out, torch.ones(4))


def test_a_copy_whose_source_was_freed_before_it_completed_is_an_error():
    streams = SimulatedStreams(latency=None)
    src = torch.ones(1024)
    streams.copy_to_host(src, torch.empty(1024))
    del src
    with pytest.raises(RuntimeError, match="freed before the copy completed"):
        streams.complete()


def test_cpu_tensors_get_the_stand_in_whose_copies_complete_at_once():
    streams = streams_for(torch.device("cpu"))
    assert isinstance(streams, SimulatedStreams) and streams.latency == 0


def test_a_batch_size_trial_reads_the_default_budget_once_the_optimizer_state_exists(tmp_path, monkeypatch):
    """With no budget given, the budget is the device's available memory; read before the
    optimizer state exists it would count that state as free, so the budget would not bind."""
    import pytorch_lightning as pl

    import lightning_remat.lightning.trial as trial_module
    from tests.test_batch_size import SizedConvNet, _search_settings, small_trainer

    seen: dict = {}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            reads: list[int] = []

            def available(device):  # what mem_get_info would say: less once the state exists
                reads.append(len(optimizer.state))
                return 10**9 - 10**6 * len(optimizer.state)

            monkeypatch.setattr(trial_module, "default_budget", available)
            settings = dataclasses.replace(_search_settings(trainer, 10**9), budget_from_device=True)
            trial = trial_module.LightningTrial(trainer, pl_module, batch_arg_name="batch_size", steps_per_trial=1,
                                                solver="plain", settings=settings)
            seen["result"], seen["reads"] = trial(4), reads
            seen["state_after"] = len(optimizer.state)
            raise pl.utilities.exceptions._TunerExitException()

    trainer = small_trainer(tmp_path, max_steps=1, callbacks=[Probe()])
    trainer.fit(SizedConvNet(batch_size=2))
    assert seen["reads"] and seen["reads"][-1] > 0  # read after the warm-up step made the state
    assert seen["state_after"] == 0  # and the trial left no state behind
    assert seen["result"].feasible


def test_the_training_snapshot_is_kept_on_the_host_and_restored_to_the_device():
    from lightning_remat.graph.effects import preserved_training_state

    layer = torch.nn.Linear(4, 4)
    layer(torch.randn(2, 4)).sum().backward()
    before = (layer.weight.detach().clone(), layer.weight.grad.clone())
    moved = []
    original_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        moved.append(args[0] if args else kwargs.get("device"))
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = recording_to
    try:
        with preserved_training_state(layer):
            with torch.no_grad():
                layer.weight.add_(1.0)
            layer.weight.grad = None
    finally:
        torch.Tensor.to = original_to
    assert torch.device("cpu") in moved  # the copies were taken to the host
    assert torch.equal(layer.weight, before[0]) and torch.equal(layer.weight.grad, before[1])


def test_a_search_without_a_budget_plans_under_the_strategys_cache_key(tmp_path, monkeypatch):
    """memory_budget=None: the trials' plans are cached under "None", as training looks
    them up, so training at the found size does not profile again."""
    import pytorch_lightning as pl

    import lightning_remat.lightning.batch_size as batch_size
    from lightning_remat.lightning.strategy import RematStrategy

    monkeypatch.setattr(batch_size, "default_budget", lambda device: 10**9)
    trainer = pl.Trainer(strategy=RematStrategy(memory_budget=None, cache_dir=tmp_path), accelerator="cpu",
                         devices=1, logger=False, default_root_dir=str(tmp_path))
    settings = batch_size.RematBatchSizeFinder()._settings(trainer)
    assert settings.budget_bytes == 10**9 and settings.budget_from_device
    assert settings.plan.memory_budget is None  # str() of it is the strategy's cache key


class SimulatedCudaTimeline:
    """A GPU's queue in simulated time: the host dispatches (taking ``dispatch`` seconds per
    op), the device runs what is queued in order; events take the device's time."""

    def __init__(self, dispatch: float, cycles_per_s: float = 1e9) -> None:
        self.host = 0.0
        self.device = 0.0
        self.dispatch = dispatch
        self.cycles_per_s = cycles_per_s

    def install(self, monkeypatch) -> None:
        timeline = self

        class Event:
            def __init__(self, enable_timing=False):
                self.time = None

            def record(self, stream=None):
                timeline.device = max(timeline.device, timeline.host)
                self.time = timeline.device

            def elapsed_time(self, end):
                return (end.time - self.time) * 1e3

        def sleep(cycles):
            timeline.device = max(timeline.device, timeline.host) + cycles / timeline.cycles_per_s

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", sleep)

    def run_op(self, kernel_seconds: float) -> None:
        self.host += self.dispatch  # Python, the dispatcher and the launch
        self.device = max(self.device, self.host) + kernel_seconds


def test_cuda_op_times_exclude_the_python_dispatch_before_the_kernel(monkeypatch):
    from lightning_remat.graph.instruments import Clock

    timeline = SimulatedCudaTimeline(dispatch=30e-6)
    timeline.install(monkeypatch)
    clock = Clock(torch.device("cuda", 0), backlog_cycles=int(4 * 30e-6 * 1e9))
    for kernel in (2e-6, 50e-6, 400e-6):
        start = clock.begin()
        timeline.run_op(kernel)
        end = clock.mark()
        assert clock.seconds(start, end) == pytest.approx(kernel)  # not dispatch + kernel


def test_the_overlap_benchmark_finds_the_compute_streams_idle_time_in_a_trace():
    from benchmarks.overlap import compute_stream, stream_idle

    def kernel(stream, ts, dur):
        return {"cat": "kernel", "ph": "X", "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [kernel(7, 0, 100), kernel(7, 50, 100), kernel(7, 400, 100),  # busy 250 of 500 us
              kernel(20, 120, 200), {"cat": "cpu_op", "ph": "X", "ts": 0, "dur": 999}]
    idle = stream_idle(events)
    assert compute_stream(idle) == 7
    assert idle[7] == pytest.approx((0.5, 0.25, 0.25))
    assert idle[20] == pytest.approx((0.2, 0.2, 0.0))


def test_bandwidth_is_timed_on_the_models_device_not_the_current_one():
    """A model on cuda:1 while cuda:0 is current: the events must be recorded on cuda:1's
    stream, inside its device context, or the copies look free."""
    import contextlib

    from lightning_remat.runtime.offload import _cuda_bandwidth

    recorded: list[tuple[str, str]] = []
    current = ["cuda:0"]

    class Stream:
        def __init__(self, device):
            self.device = str(device)

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            recorded.append((current[0], stream.device if stream is not None else current[0]))

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    @contextlib.contextmanager
    def device(dev):
        previous, current[0] = current[0], str(dev)
        try:
            yield
        finally:
            current[0] = previous

    fake_cuda = SimpleNamespace(device=device, current_stream=lambda dev=None: Stream(dev or current[0]),
                                Event=Event, stream=lambda s: contextlib.nullcontext())
    fake_empty = lambda count, dtype, pin_memory=False, device=None: torch.empty(count, dtype=dtype)  # noqa: E731
    rate = _cuda_bandwidth(torch.device("cuda", 1), 1024, 1, cuda=fake_cuda, empty=fake_empty)
    assert rate == pytest.approx(1024 * 4 / 1e-3)
    assert recorded and set(recorded) == {("cuda:1", "cuda:1")}


def test_a_trials_plan_reads_the_default_budget_once_the_optimizer_state_exists(tmp_path, monkeypatch):
    """The plan a trial makes for memory_budget=None is solved for the memory left with the
    optimizer's state in place, as its verdict is; the state is gone again after the trial."""
    import pytorch_lightning as pl

    import lightning_remat.device as device_module
    import lightning_remat.lightning.trial as trial_module
    from tests.test_batch_size import SizedConvNet, _search_settings, small_trainer

    seen: dict = {}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            reads: list[int] = []

            def available(device):
                reads.append(len(optimizer.state))
                return 10**9 - 10**6 * len(optimizer.state)

            monkeypatch.setattr(trial_module, "default_budget", available)  # the verdict's
            monkeypatch.setattr(device_module, "default_budget", available)  # the plan's
            settings = _search_settings(trainer, 10**9)
            settings = dataclasses.replace(settings, budget_from_device=True,
                                           plan=dataclasses.replace(settings.plan, memory_budget=None))
            trial = trial_module.LightningTrial(trainer, pl_module, batch_arg_name="batch_size", steps_per_trial=1,
                                                solver="auto", settings=settings)
            seen["result"], seen["reads"] = trial(4), reads
            seen["state_after"] = len(optimizer.state)
            raise pl.utilities.exceptions._TunerExitException()

    trainer = small_trainer(tmp_path, max_steps=1, callbacks=[Probe()])
    trainer.fit(SizedConvNet(batch_size=2))
    # The first asks whether the device has a limit; the plan's reading and the verdict's
    # are both taken with the optimizer's state in place.
    readings = seen["reads"][1:]
    assert len(readings) == 2 and min(readings) > 0
    assert seen["state_after"] == 0 and seen["result"].feasible


def test_the_strategy_reads_a_default_budget_with_the_optimizer_state_in_place(tmp_path, monkeypatch):
    """memory_budget=None plans at the first step, before the optimizer's first step makes
    its state: the budget is read with that state made for the reading and undone, so the
    training is the same as without it."""
    import pytorch_lightning as pl

    import lightning_remat.device as device_module
    from lightning_remat.lightning.strategy import RematStrategy
    from tests.lit_models import ConvNet, loaders, trainer_kwargs

    class MomentumNet(ConvNet):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def fit(root):
        pl.seed_everything(0)
        model = MomentumNet()
        trainer = pl.Trainer(strategy=RematStrategy(memory_budget=None, cache_dir=root),
                             **trainer_kwargs(root, max_steps=2))
        reads_of[:] = [trainer]
        trainer.fit(model, loaders(n=32, batch_size=8)[0])
        return model, trainer

    reads_of: list = []
    plain, _ = fit(tmp_path / "plain")  # the CPU: no limit, nothing read
    reads: list[int] = []

    def available(device):
        trainer = reads_of[0]
        reads.append(sum(len(o.state) for o in trainer.optimizers))
        return 10**9 - 10**6 * reads[-1]

    monkeypatch.setattr(device_module, "default_budget", available)
    model, trainer = fit(tmp_path / "read")
    states = reads[1::2]  # each reading: once to ask whether there is a limit, once with the state
    assert states and min(states) > 0
    assert trainer.strategy.planner.last.budget_bytes == 10**9 - 10**6 * states[0]
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
