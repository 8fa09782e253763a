"""Can Qt open a window here? The system libraries its platform plugin needs, checked before Qt starts.

Qt aborts the process when its platform plugin cannot load ("could not load the Qt platform plugin
xcb") and names no missing library. The plugin's own dependency check is the dynamic loader's: `ldd`
on the plugin lists every library it would load and marks the absent ones "not found". The launcher
runs this before the window starts and `speclens doctor` reports it. Nothing here imports Qt.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Library -> its package on Debian/Ubuntu, Fedora, Arch (what Qt's xcb, wayland and offscreen plugins load).
PACKAGES: dict[str, tuple[str, str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm", "xcb-util-wm"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image", "xcb-util-image"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms", "xcb-util-keysyms"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util", "xcb-util"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon", "libxkbcommon"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb", "libx11"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl", "libglvnd"),
    "libGL.so.1": ("libgl1", "libglvnd-glx", "libglvnd"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl", "libglvnd"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype", "freetype2"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs", "dbus"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2", "glib2"),
    "libwayland-client.so.0": ("libwayland-client0", "libwayland-client", "wayland"),
    "libwayland-cursor.so.0": ("libwayland-cursor0", "libwayland-cursor", "wayland"),
}
for _name in ("xinerama", "xkb", "shape", "randr", "sync", "xfixes", "shm", "render", "xinput", "glx"):
    PACKAGES.setdefault(f"libxcb-{_name}.so.{1 if _name in ('xkb', 'sync') else 0}",
                        (f"libxcb-{_name}{1 if _name in ('xkb', 'sync') else 0}", "libxcb", "libxcb"))
INSTALLERS = ("sudo apt install", "sudo dnf install", "sudo pacman -S")  # the order of PACKAGES' tuples
_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found", re.MULTILINE)


@dataclass(frozen=True)
class PlatformCheck:
    platform: str  # the Qt platform plugin that will be used: xcb, wayland, offscreen, ...
    plugin: Path | None  # its file (None: not found, or not a Linux desktop)
    missing: tuple[str, ...] = ()  # libraries the loader does not find
    note: str = ""  # why nothing was checked, when nothing was

    available: tuple[str, ...] = ()  # the platform plugins installed, when the asked one is not

    @property
    def ok(self) -> bool:
        return not self.missing and not self.available


def qt_platform() -> str:
    """The plugin Qt picks: QT_QPA_PLATFORM's first choice, else wayland in a Wayland session, else xcb."""
    chosen = os.environ.get("QT_QPA_PLATFORM", "").split(";")[0].split(":")[0].strip()
    if chosen:
        return chosen
    wayland = os.environ.get("WAYLAND_DISPLAY") or os.environ.get("XDG_SESSION_TYPE") == "wayland"
    return "wayland" if wayland and not os.environ.get("DISPLAY") else "xcb"


def _plugins_dir() -> Path | None:
    spec = importlib.util.find_spec("PySide6")  # the package's folder only: no Qt library is loaded
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "Qt" / "plugins" / "platforms"


def check_platform(platform: str | None = None, plugins: Path | None = None) -> PlatformCheck:
    """The libraries `platform`'s plugin needs that this system lacks, by `ldd` on the plugin (Linux)."""
    platform = platform or qt_platform()
    if not sys.platform.startswith("linux"):
        return PlatformCheck(platform, None, note="checked on Linux only")
    folder = plugins or _plugins_dir()
    plugin = folder / f"libq{platform}.so" if folder else None
    if folder is None:
        return PlatformCheck(platform, None, note="PySide6's plugins folder was not found")
    if not plugin.exists():  # Qt would abort: say which platforms there are
        installed = tuple(sorted(p.name[4:-3] for p in folder.glob("libq*.so"))) or ("none",)
        return PlatformCheck(platform, None, note=f"no Qt plugin for platform {platform!r}", available=installed)
    ldd = shutil.which("ldd")
    if ldd is None:
        return PlatformCheck(platform, plugin, note="ldd is not installed: the plugin's libraries were not checked")
    try:
        out = subprocess.run([ldd, str(plugin)], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return PlatformCheck(platform, plugin, note=f"ldd failed: {exc}")
    return PlatformCheck(platform, plugin, tuple(dict.fromkeys(_NOT_FOUND.findall(out))))


def install_advice(check: PlatformCheck) -> str:
    """One paragraph: what is missing and the command that installs it on each family of Linux."""
    if check.available:
        return (f"SpecLens cannot open its window: Qt has no platform plugin {check.platform!r} (QT_QPA_PLATFORM). "
                f"Installed: {', '.join(check.available)}. Unset QT_QPA_PLATFORM, or set it to one of those.")
    names = ", ".join(check.missing)
    lines = [f"SpecLens cannot open its window: Qt's {check.platform!r} platform plugin needs {names}, "
             "which this system lacks. Install them with the command for your system, then start SpecLens again:"]
    for column, installer in enumerate(INSTALLERS):
        packages = dict.fromkeys(PACKAGES.get(lib, (lib,) * 3)[column] for lib in check.missing)
        lines.append(f"  {installer} {' '.join(packages)}")
    lines.append("(Without a screen, QT_QPA_PLATFORM=offscreen runs the window headless; the command line needs "
                 "no window: `speclens generate --help`.)")
    return "\n".join(lines)


def no_display_reason(platform: str | None = None) -> str | None:
    """Why a window cannot open on `platform` for want of a display (None: there is one, or it needs none)."""
    platform = platform or qt_platform()
    if platform == "xcb" and not os.environ.get("DISPLAY"):
        return ("SpecLens cannot open its window: no X display (DISPLAY is not set). Start it from a desktop "
                "session, or run it headless with QT_QPA_PLATFORM=offscreen; the command line needs no window "
                "(`speclens generate --help`).")
    if platform == "wayland" and not os.environ.get("WAYLAND_DISPLAY"):
        return "SpecLens cannot open its window: no Wayland display (WAYLAND_DISPLAY is not set)."
    return None
