import ast
import configparser
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"


def test_desktop_entry_matches_the_application():
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str
    entry.read(PACKAGING / "speclens.desktop")
    desktop = entry["Desktop Entry"]
    main_source = (ROOT / "app" / "main.py").read_text()
    app_name = re.search(r'setApplicationName\("([^"]+)"\)', main_source).group(1)
    assert desktop["StartupWMClass"] == app_name
    assert desktop["Exec"].split()[0] == "speclens-gui"
    assert (ROOT / "resources" / "icons" / f"{desktop['Icon']}.svg").exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'speclens-gui = "speclens.app.main:main"' in pyproject


def test_appstream_metadata_is_well_formed():
    root = ET.parse(PACKAGING / "io.github.speclens.SpecLens.metainfo.xml").getroot()
    assert root.tag == "component" and root.get("type") == "desktop-application"
    assert root.findtext("launchable") == "speclens.desktop"
    assert root.findtext("id") == "io.github.speclens.SpecLens"


def test_freezing_recipe_parses_and_its_paths_exist():
    spec = (PACKAGING / "speclens.spec").read_text()
    ast.parse(spec)
    paths = re.findall(r'ROOT / "([^"]+)"(?: / "([^"]+)")?(?: / "([^"]+)")?', spec)
    assert len(paths) >= 3, paths  # the entry script, resources and the native kernel's source at least
    for relative in paths:
        path = ROOT.joinpath(*[part for part in relative if part])
        assert path.exists(), path


def test_doctor_runs():
    result = subprocess.run([sys.executable, "-m", "speclens.app.launcher", "doctor"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and "torch:" in result.stdout and "default model:" in result.stdout, (
        result.stdout + result.stderr)


def _setuptools_at_least(major: int) -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= major


def test_the_wheel_installs_one_speclens_package_that_runs_outside_the_repository(tmp_path):
    """Build the wheel, install it into a fresh environment (its dependencies borrowed from this one
    through a .pth file) and run `speclens doctor` away from the checkout: the wheel must carry every
    module and resource, under `speclens.` alone (no top-level `engine` or `app` to clash with)."""
    import sysconfig

    wheels = tmp_path / "wheels"
    # Offline where this environment has a recent setuptools; otherwise pip fetches one from PyPI.
    flags = ["--no-build-isolation"] if _setuptools_at_least(68) else []
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *flags, "-q", "-w", str(wheels), str(ROOT)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("speclens-*.whl")
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Only this environment's plain packages: a .pth line adds a folder, not the .pth files inside it
    # (so the checkout's editable install does not come along).
    Path(site, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                              str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = ("import importlib, importlib.resources, importlib.util, speclens.engine, speclens.app\n"
             "print(speclens.engine.__file__)\n"
             "print([importlib.util.find_spec(name) is None for name in ('engine', 'app', 'resources')])\n"
             "files = importlib.resources.files('speclens.resources')\n"
             "print((files / 'drafters' / 'eagle-smollm2-135m' / 'config.json').is_file())\n"
             "importlib.import_module('speclens.engine.tools.train.run')\n"
             "print(importlib.resources.files('speclens.engine.runtime').joinpath('native_kernels.cpp').is_file())\n")
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=outside)
    assert result.returncode == 0, result.stdout + result.stderr
    where, absent, heads, kernel = result.stdout.split("\n")[:4]
    assert Path(where).is_relative_to(env) and not Path(where).is_relative_to(ROOT), where
    assert absent == "[True, True, True]" and heads == "True" and kernel == "True", result.stdout
    doctor = subprocess.run([str(env / "bin" / "speclens"), "doctor"], capture_output=True, text=True, cwd=outside)
    assert doctor.returncode == 0 and "default model:" in doctor.stdout, doctor.stdout + doctor.stderr


def test_the_gpu_training_script_runs_in_its_tiny_cpu_mode(tmp_path):
    """packaging/gpu_train.sh, prepared for a GPU session, in seconds on a CPU: it distils into new
    shards, trains EAGLE, EAGLE-3, DFlash and Medusa heads from every shard and leaves heads, cards and
    shards only."""
    import json
    import os

    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "packaging" / "gpu_train.sh"), "--tiny", "--device", "cpu", str(out)],
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    (shard,) = (out / "shards").glob("*.safetensors")
    for kind in ("eagle", "eagle3", "dflash", "medusa"):
        assert (out / kind / "model.safetensors").is_file() and (out / kind / "README.md").is_file()
        record = json.loads((out / kind / "training.json").read_text())
        assert record["run"]["n_samples"][-1] == 16  # 8 greedy + 8 sampled answers, read back from the shard
        assert not list((out / kind).glob("*.pt"))  # no distillation state comes back
    assert not (out / "distil").exists()
