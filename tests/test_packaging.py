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
