"""Plugins as separate distributions: the third-party path end to end, faults, and the conformance
suite catching broken components."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specstack import CacheState, Capability, Draft, EvictionPolicy, Kind, Registry, StreamingLLM
from specstack.testing import conformance
from specstack.verify import SpeculativeSamplingVerifier

EVERY_OTHER = '''
import torch
from specstack import EvictionPolicy, SpecstackError
from specstack.hookspecs import hookimpl


class EveryOther(EvictionPolicy):
    """Keeps the newest half of the budget and every other slot before it."""
    name = "every-other"

    def __init__(self, *, budget: int = 64):
        if budget < 4:
            raise SpecstackError(f"every-other budget {budget} is not allowed; use an integer >= 4")
        self.budget = budget

    def capacity(self, max_length):
        return min(max_length, self.budget + 8)

    def select(self, state):
        n, keep = state.positions.shape[0], min(self.budget, state.room)
        recent = torch.arange(n - keep // 2, n)
        older = torch.arange(0, n - keep // 2, 2)[-(keep - keep // 2):]
        return torch.cat([older, recent])


@hookimpl
def specstack_cache_policies():
    return [EveryOther]
'''

EXAMPLE = Path(__file__).parents[1] / "examples" / "quest-policy"

FAULTY = {
    "broken-import": "raise ImportError('needs a package that is not installed')\n",
    "duplicate-name": (
        "from specstack import StreamingLLM\nfrom specstack.hookspecs import hookimpl\n\n"
        "class Impostor(StreamingLLM):\n    name = 'streaming'\n\n"
        "@hookimpl\ndef specstack_cache_policies():\n    return [Impostor]\n"
    ),
    "misspelled-hook": "def specstack_cache_policys():\n    return []\n",
}


def _distribution(root: Path, name: str, code: str) -> Path:
    """A minimal plugin distribution: one module and an entry point into the ``specstack`` group."""
    module = name.replace("-", "_")
    folder = root / name
    folder.mkdir()
    (folder / f"{module}.py").write_text(code)
    (folder / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "0.0.1"
        [project.entry-points.specstack]
        {name} = "{module}"
        [tool.setuptools]
        py-modules = ["{module}"]
        """))
    return folder


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Throw-away plugin distributions, built and installed with pip into a private directory."""
    root = tmp_path_factory.mktemp("plugins")
    sources = [_distribution(root, "every-other", EVERY_OTHER)]
    sources += [_distribution(root, name, code) for name, code in FAULTY.items()]
    sources += [shutil.copytree(EXAMPLE, root / EXAMPLE.name)]  # the walk-through's Quest policy
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
         "--target", str(target), *map(str, sources)],
        check=True, capture_output=True,
    )
    return target


def _python(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name, distribution", [("every-other", "every-other"), ("quest", "quest-policy")])
def test_an_installed_third_party_policy_is_used_by_name(site, name, distribution) -> None:
    script = textwrap.dedent(f"""\
        import random
        from specstack import Kind, Registry
        from specstack.synthetic import SyntheticLM, greedy_decode
        registry = Registry.create()
        print(registry.entry(Kind.CACHE_POLICY, "{name}").distribution)
        target = SyntheticLM(vocab_size=16, seed=1, sharpness=2.0)
        prompt = [random.Random(0).randrange(16) for _ in range(200)]
        stack = registry.stack("self-speculative", target=target, policy="{name}", budget=32, gamma=3)
        result = stack.generate(prompt, 20)
        print(list(result.tokens) == greedy_decode(target, prompt, 20), result.levels[0].forward_calls)
        """)
    out = _python(site, "-c", script)
    assert out.returncode == 0, out.stderr
    found, verdict = out.stdout.splitlines()
    assert found == distribution
    assert verdict.startswith("True ")


@pytest.mark.parametrize("name", ["every-other", "quest"])
def test_the_conformance_suite_runs_on_the_installed_plugin_in_one_line(site, name) -> None:
    out = _python(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "specstack.testing.conformance", "-k", name)
    assert out.returncode == 0, out.stdout[-2000:]
    assert "5 passed" in out.stdout


def test_faulty_plugins_are_named_and_the_others_keep_working(site) -> None:
    out = _python(site, "-m", "specstack.cli", "plugins")
    assert out.returncode == 0, out.stderr
    listing = out.stdout
    for name, dist in [("every-other", "every-other"), ("h2o", "specstack-h2o"), ("topk-oracle", "specstack-topk-oracle"), ("streaming", "specstack")]:
        assert any(line.split()[:3] == [name, "from", dist] for line in listing.splitlines()), (name, listing)
    assert "problem: plugin 'broken-import' failed to import" in listing and "ImportError" in listing
    assert "problem: plugin 'duplicate-name' cache policy 'streaming' is already registered by specstack.builtins" in listing
    assert "problem: plugin 'misspelled-hook' cannot be registered" in listing and "specstack_cache_policys" in listing


# -- the conformance suite fails on broken components -------------------------------------------


class SinkDropper(StreamingLLM):
    name = "sink-dropper"

    def select(self, state: CacheState) -> torch.Tensor:
        n = state.positions.shape[0]
        return torch.arange(n - state.room, n)  # only the most recent: the declared sinks are lost


class OverBudget(EvictionPolicy):
    name = "over-budget"

    def __init__(self, *, budget: int = 64) -> None:
        self.budget = budget

    def capacity(self, max_length: int) -> int:
        return self.budget + 16

    def select(self, state: CacheState) -> torch.Tensor:
        return torch.arange(state.positions.shape[0] - state.room, state.positions.shape[0])  # fills the room, beyond the budget


class PerHeadNoSharedTail(EvictionPolicy):
    name = "per-head-no-shared-tail"
    requires = frozenset({Capability.ATTENTION_WEIGHTS})

    def __init__(self, *, budget: int = 32) -> None:
        self.budget = budget

    def capacity(self, max_length: int) -> int:
        return self.budget + 8

    def select(self, state: CacheState) -> torch.Tensor:
        keep = min(self.budget, state.room)
        return state.attention.topk(keep, dim=-1).indices.sort(dim=-1).values  # [L, H, keep]: heaviest only, no shared recent window


class AlwaysAccept(SpeculativeSamplingVerifier):
    name = "always-accept"

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator):
        return super().verify(draft, torch.cat([draft.probs, p[len(draft):]]), generator)  # judges the draft by itself


@pytest.mark.parametrize("broken, check", [
    (SinkDropper, conformance.test_eviction_keeps_the_contract),
    (OverBudget, conformance.test_eviction_keeps_the_contract),
    (PerHeadNoSharedTail, conformance.test_eviction_keeps_the_contract),
])
def test_the_suite_catches_a_broken_policy(broken, check) -> None:
    with pytest.raises(AssertionError):
        check(policy_class=broken)


def test_the_suite_catches_a_biased_verifier() -> None:
    with pytest.raises(AssertionError, match="not distributed as the target"):
        conformance.test_verdicts_follow_the_target(AlwaysAccept)


def test_the_plugins_are_installed_distributions_not_part_of_specstack() -> None:
    registry = Registry.create()
    assert registry.entry(Kind.CACHE_POLICY, "h2o").distribution == "specstack-h2o"
    assert registry.entry(Kind.CACHE_POLICY, "topk-oracle").distribution == "specstack-topk-oracle"
    source = Path(__file__).parents[1] / "specstack"
    assert not [p for p in source.rglob("*.py") if "specstack_h2o" in p.read_text() or "specstack_topk_oracle" in p.read_text()]
