"""Before Qt starts: the libraries its platform plugin lacks, found with the loader's own check (ldd), and
the one paragraph that says what to install."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from speclens.engine.tools import display
from speclens.engine.tools.display import PlatformCheck, check_platform, install_advice, no_display_reason


@pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("gcc") or not shutil.which("ldd"),
                    reason="builds a shared library and asks ldd (Linux)")
def test_a_plugin_whose_library_is_gone_is_reported_by_name(tmp_path):
    # a stand-in plugin linked against a library that is then removed: what a desktop without
    # libxcb-cursor0 gives Qt's xcb plugin (under a name no system has)
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    (tmp_path / "plugin.c").write_text("int dep(void); int plugin(void) { return dep(); }\n")
    lib = "libspeclens-absent.so.3"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / lib, tmp_path / "dep.c", f"-Wl,-soname,{lib}"],
                   check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / "libqfake.so", tmp_path / "plugin.c", tmp_path / lib],
                   check=True)
    (tmp_path / lib).unlink()
    check = check_platform("fake", plugins=tmp_path)
    assert check.missing == (lib,) and not check.ok
    assert f"sudo apt install {lib}" in install_advice(check)  # an unknown library is named as it is


def test_the_advice_names_each_familys_packages():
    advice = install_advice(PlatformCheck("xcb", None, ("libxcb-cursor.so.0",)))
    assert "sudo apt install libxcb-cursor0" in advice and "sudo dnf install xcb-util-cursor" in advice
    assert "sudo pacman -S xcb-util-cursor" in advice


def test_the_installed_offscreen_plugin_loads_here():
    check = check_platform("offscreen")
    assert check.ok and (check.plugin is not None or check.note), check


def test_the_launcher_says_what_to_install_instead_of_letting_qt_abort(monkeypatch, capsys):
    from speclens.app import launcher

    missing = PlatformCheck("xcb", None, ("libxcb-cursor.so.0", "libxkbcommon-x11.so.0"))
    monkeypatch.setattr(display, "check_platform", lambda: missing)
    monkeypatch.setattr("speclens.app.main.main", lambda argv: pytest.fail("the window was started"))
    assert launcher.main([]) == 1
    err = capsys.readouterr().err
    assert "needs libxcb-cursor.so.0, libxkbcommon-x11.so.0" in err
    assert "sudo apt install libxcb-cursor0 libxkbcommon-x11-0" in err and "Traceback" not in err


def test_no_display_is_said_before_qt_starts(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    assert "DISPLAY is not set" in no_display_reason("xcb")
    assert no_display_reason("offscreen") is None
    monkeypatch.setenv("DISPLAY", ":0")
    assert no_display_reason("xcb") is None


def test_the_platform_qt_picks(monkeypatch):
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    assert display.qt_platform() == "offscreen"
    monkeypatch.delenv("QT_QPA_PLATFORM")
    monkeypatch.setenv("DISPLAY", ":1")
    assert display.qt_platform() == "xcb"


def test_an_invalid_platform_is_said_instead_of_qt_aborting(tmp_path):
    """The failure forced for real: the launcher in a fresh process, with a platform Qt does not have."""
    env = {**__import__("os").environ, "QT_QPA_PLATFORM": "nonexistent", "SPECLENS_CONFIG_DIR": str(tmp_path),
           "SPECLENS_DATA_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "speclens.app"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr  # not Qt's abort (SIGABRT, -6)
    assert "Qt has no platform plugin 'nonexistent'" in run.stderr and "offscreen" in run.stderr
    assert "Traceback" not in run.stderr and "could not load the Qt platform plugin" not in run.stderr.lower()
