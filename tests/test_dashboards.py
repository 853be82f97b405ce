import json
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat.cli import main as cli_main
from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger
from lightning_remat.lightning.strategy import RematStrategy
from tests.lit_models import ConvNet, loaders, trainer_kwargs

STEP_TAGS = {"remat/peak_MiB", "remat/step_seconds", "remat/budget_MiB",
             "remat/predicted_peak_MiB", "remat/extra_time_ratio"}
TIMELINE_TAGS = {"remat/timeline/measured_MiB", "remat/timeline/predicted_MiB", "remat/timeline/budget_MiB"}
MIB = 2**20


@pytest.fixture(scope="module")
def remat_run(tmp_path_factory):
    """A ConvNet (captured by torch.fx) trained at 50% with the Trainer's default logger."""
    root = tmp_path_factory.mktemp("run")
    pl.seed_everything(0)
    kwargs = trainer_kwargs(root, max_epochs=1)
    kwargs["logger"] = True  # the default: a TensorBoardLogger under default_root_dir
    trainer = pl.Trainer(strategy=RematStrategy(memory_budget="50%", cache_dir=root / "cache"), **kwargs)
    assert isinstance(trainer.logger, TensorBoardLogger)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ConvNet(), loaders()[0])
    trainer.caught_warnings = [str(w.message) for w in caught]
    trainer.logger.experiment.flush()
    return Path(trainer.logger.log_dir), trainer


def _accumulator(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


def test_strategy_adds_the_logger_and_writes_every_tag(remat_run):
    log_dir, trainer = remat_run
    assert any(isinstance(cb, MemoryTimelineLogger) for cb in trainer.callbacks)
    acc = _accumulator(log_dir)
    scalars = set(acc.Tags()["scalars"])
    assert STEP_TAGS | TIMELINE_TAGS <= scalars
    assert "remat/timeline" in acc.Tags()["images"]
    assert "remat/plan/text_summary" in acc.Tags()["tensors"]
    peaks = acc.Scalars("remat/peak_MiB")
    assert len(peaks) == trainer.global_step and all(e.value > 0 for e in peaks)
    budget = acc.Scalars("remat/budget_MiB")[0].value
    predicted = acc.Scalars("remat/predicted_peak_MiB")[0].value
    assert 0 < predicted <= budget
    entry = trainer.strategy.planner.last
    series = [e.value for e in acc.Scalars("remat/timeline/predicted_MiB")]
    assert series == pytest.approx([e.peak_bytes / MIB for e in entry.predicted_timeline().events], rel=1e-6)
    # Each op's highest bytes: the line's top is the plan's predicted peak.
    assert max(series) == pytest.approx(entry.plan.predicted_peak_bytes / MIB, rel=1e-6)
    measured = acc.Scalars("remat/timeline/measured_MiB")
    assert len(measured) == len(series) > 2 * len(entry.graph)  # forward and backward ops


def test_the_plan_made_inside_a_metered_step_is_profiled_with_the_allocation_log(remat_run):
    """The memory timeline meters each CPU step with torch.profiler's allocation log, and
    the first step plans inside it: the planner's own meter still reads every allocation
    (op-internal buffers included), not the storage-only fallback."""
    _, trainer = remat_run
    assert not [m for m in trainer.caught_warnings if m.startswith("another torch.profiler")]
    assert trainer.strategy.planner.last.graph.meta.plain_peak_bytes > 0


# ---- each capture's timeline, read back with TensorBoard's reader --------------------------------
class LlamaLM(pl.LightningModule):
    """A tiny Llama as transformers ships its config (the cache on, sdpa attention, dropout
    as set), whose forward calls the model with keywords: torch.fx cannot trace it, so
    non-strict torch.export captures it. The training step leaves ``attention_mask`` out,
    so only keywords bind ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        from tests.hf_architectures import build

        torch.manual_seed(0)
        self.model, call = build("llama", batch=8, length=64)
        self.rows = [{"input_ids": i, "labels": y} for i, y in zip(call["input_ids"], call["labels"])]

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, batch_idx):
        return self(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(self.rows, batch_size=len(self.rows))


class BranchyLM(pl.LightningModule):
    """A forward neither torch.fx nor torch.export captures (a branch on a tensor's value):
    its own forward runs, with its submodules checkpointed where it calls them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Linear(64, 256), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh())
                                    for _ in range(6))
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        h = self.first(x)
        if h.sum() < -1e9:  # never true, but no capture can know
            h = -h
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(2048, 64, generator=g), torch.randint(0, 10, (2048,), generator=g))
        return DataLoader(data, batch_size=2048)


CAPTURES = {"torch.fx": "capture: torch.fx", "torch.export": "capture: torch.export",
            "own forward": "capture: the module's own forward"}


@pytest.fixture(scope="module", params=list(CAPTURES))
def captured_run(request, tmp_path_factory):
    """One training step at a fraction of the plain peak with the Trainer's default logger,
    for each capture: the ConvNet run for torch.fx."""
    if request.param == "torch.fx":
        return request.param, *request.getfixturevalue("remat_run")
    if request.param == "torch.export":
        pytest.importorskip("transformers")
        module, budget = LlamaLM(), "50%"
    else:
        module, budget = BranchyLM(), "75%"
    root = tmp_path_factory.mktemp("capture")
    kwargs = trainer_kwargs(root, max_steps=1)
    kwargs["logger"] = True
    trainer = pl.Trainer(strategy=RematStrategy(memory_budget=budget, cache_dir=root / "cache"), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the capture's own warning, Lightning's about the loader
        trainer.fit(module)
    trainer.logger.experiment.flush()
    return request.param, Path(trainer.logger.log_dir), trainer


def test_the_measured_line_has_a_point_per_predicted_op_over_the_forward_and_the_backward(captured_run):
    """Every capture: the measured timeline as TensorBoard reads it has one point per op of
    the predicted one, forward and backward, on the same x axis (the op's index), each the
    same op's reading; the budget line spans it."""
    capture, log_dir, trainer = captured_run
    entry = trainer.strategy.planner.last
    assert any(note.startswith(CAPTURES[capture]) for note in entry.plan.notes), entry.plan.notes
    events = entry.predicted_timeline().events
    n = len(events)
    acc = _accumulator(log_dir)
    predicted, measured = acc.Scalars("remat/timeline/predicted_MiB"), acc.Scalars("remat/timeline/measured_MiB")
    assert [e.step for e in measured] == [e.step for e in predicted] == list(range(n))
    assert {"forward", "backward"} <= {e.phase for e in events}
    predicted_values, measured_values = [e.value for e in predicted], [e.value for e in measured]
    peak = max(predicted_values)
    beside = [abs(m - p) <= 0.1 * peak for m, p in zip(measured_values, predicted_values)]
    backward = [i for i, e in enumerate(events) if e.phase != "forward"]
    assert sum(beside) >= 0.9 * n
    assert sum(beside[i] for i in backward) >= 0.9 * len(backward)
    assert abs(max(measured_values) - peak) <= 0.1 * peak
    budget = acc.Scalars("remat/timeline/budget_MiB")
    assert [e.step for e in budget] == [0, n - 1]
    assert budget[0].value == pytest.approx(entry.budget_bytes / MIB, rel=1e-6)  # MiB, not bytes


def test_the_custom_scalars_charts_plot_logged_series_in_mib(remat_run):
    """The custom-scalars layout as TensorBoard reads it: every chart's series is logged,
    and in MiB (its axis reads 25.0, not 2.6e+07)."""
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    log_dir, trainer = remat_run
    acc = _accumulator(log_dir)
    proto = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)[-1].tensor_proto
    layout = layout_pb2.Layout.FromString(proto.string_val[0])
    charts = [chart for category in layout.category for chart in category.chart]
    assert len(charts) == 2 and all("MiB" in chart.title for chart in charts)
    scalars = set(acc.Tags()["scalars"])
    for chart in charts:
        tags = list(chart.multiline.tag)
        assert tags and all(tag.endswith("_MiB") and tag in scalars for tag in tags), tags
    step_peak = acc.Scalars("remat/peak_MiB")[0].value
    assert 1 < step_peak < 1024  # the ConvNet's step: tens of MiB, read as MiB


def _hparams_table(log_dir):
    """The HParams dashboard's experiment (its columns) and session groups (its rows), as
    TensorBoard's hparams plugin serves them for ``log_dir``."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import (
        api_pb2,
        backend_context,
        get_experiment,
        list_session_groups,
    )

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(log_dir))
    multiplexer.Reload()
    backend = backend_context.Context(base_plugin.TBContext(
        logdir=str(log_dir), multiplexer=multiplexer,
        data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(log_dir))))
    request_context = context.RequestContext()
    experiment = get_experiment.Handler(request_context, backend, "", api_pb2.GetExperimentRequest()).run()
    every_status = [api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING]
    groups = list_session_groups.Handler(request_context, backend, "", api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, allowed_statuses=every_status)).run()
    return experiment, list(groups.session_groups)


def test_the_hparams_row_has_the_budget_and_the_solver(captured_run):
    """Every capture: TensorBoard's HParams dashboard shows the budget as given and the
    solver in the run's row, with the budget and the peaks in MiB as its metrics, beside
    the hyperparameters Lightning logs (the ConvNet's own)."""
    capture, log_dir, trainer = captured_run
    experiment, groups = _hparams_table(log_dir)
    columns = {h.name for h in experiment.hparam_infos}
    assert {"remat/memory_budget", "remat/solver"} <= columns
    assert {"remat/budget_MiB", "remat/predicted_peak_MiB", "remat/peak_MiB"} <= {m.name.tag for m in experiment.metric_infos}
    [row] = groups
    assert row.hparams["remat/memory_budget"].string_value == str(trainer.strategy.memory_budget)
    assert row.hparams["remat/solver"].string_value == "auto"
    metrics = {m.name.tag: m.value for m in row.metric_values}
    entry = trainer.strategy.planner.last
    assert metrics["remat/budget_MiB"] == pytest.approx(entry.budget_bytes / MIB, rel=1e-6)
    assert metrics["remat/predicted_peak_MiB"] == pytest.approx(entry.plan.predicted_peak_bytes / MIB, rel=1e-6)
    if capture == "torch.fx":  # the ConvNet saves its hyperparameters: Lightning's columns stay
        assert {"channels", "lr"} <= columns and row.hparams["lr"].number_value == pytest.approx(0.05)


def test_callback_alone_logs_measured_scalars(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    kwargs = trainer_kwargs(tmp_path, max_epochs=1, callbacks=[MemoryTimelineLogger()])
    kwargs["logger"] = logger
    pl.Trainer(strategy="auto", **kwargs).fit(ConvNet(), loaders()[0])
    logger.experiment.flush()
    scalars = set(_accumulator(tmp_path / "tb" / "version_0").Tags()["scalars"])
    assert {"remat/peak_MiB", "remat/step_seconds"} <= scalars
    assert not scalars & TIMELINE_TAGS


def test_report_writes_a_png_and_prints_the_plan(remat_run, tmp_path, capsys):
    log_dir, _ = remat_run
    out = tmp_path / "timeline.png"
    assert cli_main(["report", str(log_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    # For a terminal: the table aligned as format_plan prints it, not TensorBoard's Markdown,
    # and the run it read named.
    assert "stage  action" in text and "recompute" in text and "  solver: " in text
    assert "**" not in text and "|---" not in text and "`" not in text
    assert text.splitlines()[0].startswith("run: ")
    # The timeline's predicted peak is the one the plan's summary states.
    summary = next(line for line in text.splitlines() if line.strip().startswith("predicted peak"))
    timeline = next(line for line in text.splitlines() if line.startswith("timeline peak:"))
    assert timeline.endswith("predicted " + summary.split(":", 1)[1].strip()), (summary, timeline)


def test_the_timeline_figure_leaves_matplotlibs_backend_and_figures_as_they_were(remat_run, tmp_path):
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    plt.switch_backend("svg")  # a backend of the user's, not the Agg a PNG needs
    try:
        figures = plt.get_fignums()
        log_dir, _ = remat_run
        assert cli_main(["report", str(log_dir), "--out", str(tmp_path / "t.png")]) == 0
        assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == figures
    finally:
        plt.switch_backend(before)


def test_report_reads_the_bytes_series_of_logs_written_before_mib(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from lightning_remat.report import read_run

    writer = SummaryWriter(str(tmp_path))
    for i, value in enumerate([1 * MIB, 3 * MIB, 2 * MIB]):
        writer.add_scalar("remat/timeline/predicted", value, i)
        writer.add_scalar("remat/timeline/measured", value + 1024, i)
    writer.add_scalar("remat/timeline/budget", 4 * MIB, 0)
    writer.close()
    report = read_run(tmp_path)
    assert report.predicted == [MIB, 3 * MIB, 2 * MIB]
    assert report.measured == [MIB + 1024, 3 * MIB + 1024, 2 * MIB + 1024] and report.budget == 4 * MIB


def test_report_on_a_dir_without_logs_says_what_to_do(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "TensorBoardLogger" in capsys.readouterr().err


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


@pytest.mark.slow
def test_tensorboard_server_serves_the_tags_and_the_image(remat_run):
    log_dir, _ = remat_run
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        tags = {}
        while time.monotonic() < deadline:
            try:
                tags = json.loads(_get(f"{base}/data/plugin/scalars/tags"))
                if tags and any("remat/timeline/predicted_MiB" in t for t in tags.values()):
                    break
            except OSError:
                pass
            time.sleep(1)
        run_tags = next(iter(tags.values()))
        assert STEP_TAGS <= set(run_tags)
        run = next(iter(tags))
        images = json.loads(_get(f"{base}/data/plugin/images/images?run={run}&tag=remat/timeline"))
        png = _get(f"{base}/data/plugin/images/individualImage?{images[0]['query']}")
        assert png[:4] == b"\x89PNG"
    finally:
        server.terminate()
        server.wait(timeout=30)
