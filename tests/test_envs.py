"""verispec's environment variables: read in verispec/envs.py and nowhere else, when asked for."""

from __future__ import annotations

import re
from pathlib import Path

from verispec import envs
from verispec.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def test_only_envs_names_verispec_variables():
    """Read there, and named there: messages and overrides elsewhere take the names from it."""
    naming = sorted(str(p.relative_to(ROOT)) for pkg in ("verispec", "benchmarks") for p in (ROOT / pkg).rglob("*.py")
                    if "VERISPEC_" in p.read_text())
    assert naming == ["verispec/envs.py"]
    documented = set(re.findall(r"`(VERISPEC_[A-Z_]+)`", (ROOT / "verispec" / "envs.py").read_text()))
    used = set(re.findall(r"[\"'](VERISPEC_[A-Z_]+)[\"']", (ROOT / "verispec" / "envs.py").read_text()))
    assert used <= documented  # every variable it reads is in its table


def test_variables_are_read_when_asked_for(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    assert envs.cache_root() == str(tmp_path)
    monkeypatch.delenv("VERISPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_root() == str(tmp_path / "xdg" / "verispec")
    # VERISPEC_COMPILE=0 is enforce_eager's default; an explicit value still wins.
    monkeypatch.setenv("VERISPEC_COMPILE", "0")
    assert EngineConfig.create().enforce_eager and not EngineConfig.create(enforce_eager=False).enforce_eager
    monkeypatch.setenv("VERISPEC_COMPILE", "1")
    assert not EngineConfig.create().enforce_eager
