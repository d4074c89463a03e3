import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import tqdm

# No tqdm monitor thread in the test processes: a child forked from one (forked.py) would inherit
# tqdm's write lock as that thread held it, if it did, and wait on it for ever.
tqdm.tqdm.monitor_interval = 0

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The suite runs in two pytest-xdist workers (pytest.ini), one a core: each worker and every process
# it starts computes on one thread, so that two workers do not fight over two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# ... nor read the user's Hugging Face cache (a VAE there would make an offline Hub id loadable): a folder of this
# run's, set before huggingface_hub reads it at import, and inherited by the processes the tests start
HF_HOME = Path(tempfile.mkdtemp(prefix="tests-hf-home-"))
for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_XET_CACHE", "HF_ASSETS_CACHE"):
    os.environ.pop(variable, None)
os.environ["HF_HOME"] = str(HF_HOME)
atexit.register(shutil.rmtree, HF_HOME, True)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide singletons; each in-process run starts clean."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fid_cache(tmp_path_factory, monkeypatch):
    """FID's reference statistics shared between runs (metrics.reference_root) in a folder of each test's own:
    no test reads another's or the user's (~/.cache/ddpm-train/fid); the processes a test starts inherit it."""
    from ddpm_train.evaluation import metrics

    monkeypatch.setenv(metrics.REFERENCE_CACHE_ENV, str(tmp_path_factory.mktemp("fid-cache")))


@pytest.fixture(scope="session", autouse=True)
def shape_scorer_dir(tmp_path_factory):
    """The shape scorers of this run, each trained at most once, in a folder of the run's own: no
    test reads or writes the user's cache (~/.cache/torch/hub/shapescore), and the processes the
    tests start inherit the folder ($SHAPES_SCORER_DIR, shapescore.CACHE_ENV)."""
    folder = tmp_path_factory.mktemp("shapescore")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SHAPES_SCORER_DIR", str(folder))
        yield folder


@pytest.fixture(scope="session")
def shape_scorer(shape_scorer_dir):
    """The tests' scorer: 16px, 1024 images, 300 steps (seconds to train, where the default trains on
    4096 images for 1200 steps), trained once per run."""
    from ddpm_train.evaluation import shapescore

    return shapescore.load_or_train(16, num_images=1024, steps=300, log=lambda _: None)


@pytest.fixture
def default_shape_scorer(shape_scorer, monkeypatch):
    """The tests' scorer is the default one for a test: what train.py, sample.py and metrics load
    in this process for 16px images of the built-in shapes."""
    from ddpm_train.evaluation import shapescore

    monkeypatch.setattr(shapescore, "TRAIN_IMAGES", shape_scorer.num_images)
    monkeypatch.setattr(shapescore, "TRAIN_STEPS", shape_scorer.steps)
    return shape_scorer


# --- the two tiers: `-m "not slow"` for the loop, the whole suite for CI ---

UNMARKED_SLOW_S = 10.0  # an unmarked test slower than this is named at the end of the run: mark it `slow`
_UNMARKED_SLOW = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > UNMARKED_SLOW_S and "slow" not in report.keywords:
        _UNMARKED_SLOW.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    for nodeid, seconds in _UNMARKED_SLOW:
        terminalreporter.write_line(f"unmarked slow test: {nodeid} took {seconds:.1f} s (over {UNMARKED_SLOW_S:g} s): "
                                    "mark it @pytest.mark.slow")  # fmt: skip
