from __future__ import annotations

import subprocess
import sys

from specstack.cli import main


def test_help_lists_the_commands(capsys) -> None:
    assert main([]) == 0
    assert "plugins" in capsys.readouterr().out


def test_console_script_help_works() -> None:
    out = subprocess.run([sys.executable, "-m", "specstack.cli", "--help"], capture_output=True, text=True, check=True).stdout
    assert "usage: specstack" in out


def test_plugins_lists_builtins_by_kind(capsys) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for line in ("cache policy:", "  full ", "  streaming ", "verifier:", "  speculative ", "stack:", "  autoregressive "):
        assert line in out


def test_synthetic_demo_reports_a_lossless_run(capsys) -> None:
    assert main(["demo", "--synthetic", "--max-new-tokens", "48"]) == 0
    out = capsys.readouterr().out
    assert "output identical to autoregressive greedy: True" in out
    assert "acceptance" in out
