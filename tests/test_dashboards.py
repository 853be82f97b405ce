import json
import socket
import subprocess
import sys
import time
import urllib.request
import warnings

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_remat.cli import main as cli_main
from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger
from lightning_remat.lightning.strategy import RematStrategy
from tests.lit_models import ConvNet, loaders, trainer_kwargs

STEP_TAGS = {"remat/peak_bytes", "remat/step_seconds", "remat/budget_bytes",
             "remat/predicted_peak_bytes", "remat/extra_time_ratio"}
TIMELINE_TAGS = {"remat/timeline/measured", "remat/timeline/predicted", "remat/timeline/budget"}


@pytest.fixture(scope="module")
def remat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    pl.seed_everything(0)
    logger = TensorBoardLogger(str(root), name="tb", version=0)
    kwargs = trainer_kwargs(root, max_epochs=1)
    kwargs["logger"] = logger
    trainer = pl.Trainer(strategy=RematStrategy(memory_budget="50%", cache_dir=root / "cache"), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ConvNet(), loaders()[0])
    trainer.caught_warnings = [str(w.message) for w in caught]
    logger.experiment.flush()
    return root / "tb" / "version_0", trainer


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
    peaks = acc.Scalars("remat/peak_bytes")
    assert len(peaks) == trainer.global_step and all(e.value > 0 for e in peaks)
    budget = acc.Scalars("remat/budget_bytes")[0].value
    predicted = acc.Scalars("remat/predicted_peak_bytes")[0].value
    assert 0 < predicted <= budget
    entry = trainer.strategy.planner.last
    series = [e.value for e in acc.Scalars("remat/timeline/predicted")]
    assert series == pytest.approx([e.peak_bytes for e in entry.predicted_timeline().events], rel=1e-6)
    # Each op's highest bytes: the line's top is the plan's predicted peak.
    assert max(series) == pytest.approx(entry.plan.predicted_peak_bytes, rel=1e-6)
    measured = acc.Scalars("remat/timeline/measured")
    assert len(measured) > len(entry.graph)  # forward and backward ops


def test_the_plan_made_inside_a_metered_step_is_profiled_with_the_allocation_log(remat_run):
    """The memory timeline meters each CPU step with torch.profiler's allocation log, and
    the first step plans inside it: the planner's own meter still reads every allocation
    (op-internal buffers included), not the storage-only fallback."""
    _, trainer = remat_run
    assert not [m for m in trainer.caught_warnings if m.startswith("another torch.profiler")]
    assert trainer.strategy.planner.last.graph.meta.plain_peak_bytes > 0


def test_callback_alone_logs_measured_scalars(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    kwargs = trainer_kwargs(tmp_path, max_epochs=1, callbacks=[MemoryTimelineLogger()])
    kwargs["logger"] = logger
    pl.Trainer(strategy="auto", **kwargs).fit(ConvNet(), loaders()[0])
    logger.experiment.flush()
    scalars = set(_accumulator(tmp_path / "tb" / "version_0").Tags()["scalars"])
    assert {"remat/peak_bytes", "remat/step_seconds"} <= scalars
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
                if tags and any("remat/timeline/predicted" in t for t in tags.values()):
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
