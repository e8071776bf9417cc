"""CI smoke run of the fuzz harnesses in bench/fuzz.py, without atheris.

Each target's harness runs over its seed corpus (committed seeds under bench/fuzz_corpus/ plus
seeds made from ../shared/data), every past crash input (bench/fuzz_corpus/regress/), and a few
hundred deterministic random mutations (python ``random`` seeded by the target name: byte flips,
truncations, insertions, deletions, chunk copies, YAML tokens; for onnx_struct, random edit
recipes). The contract: every input loads or raises MaceqError with a one-line message; other
exceptions, multi-line messages, hangs (10 s SIGALRM) and huge allocations (a 3 GiB address-space
cap) fail.

Crashes in files the fuzzing work may not edit are listed in ``fuzz.KNOWN`` (docs/fuzzing.md,
with owners and reproducers) and skipped; ``test_known_crashes_still_reproduce`` fails once one
is fixed, so the list stays honest: then delete its KNOWN entry and move its reproducer from
bench/fuzz_corpus/known/ to bench/fuzz_corpus/regress/.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("maceq_bench_fuzz", REPO / "bench" / "fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fuzz = _load_fuzz()

#: Mutations per target: the ONNX targets run the importer and the passes (~20 ms an input).
COUNTS = {"onnx_bytes": 120, "onnx_struct": 200}
DEFAULT_COUNT = 300


@pytest.mark.parametrize("name", sorted(fuzz.TARGETS))
def test_target_seeds_regressions_and_mutations(name, shared_data):
    inputs = fuzz.seeds(name) + fuzz.regressions(name) + fuzz.mutations(name, COUNTS.get(name, DEFAULT_COUNT))
    assert len(inputs) >= 100
    crashes = fuzz.run_inputs(name, inputs)
    assert crashes == [], "\n".join(f"input {k}: {msg}" for k, msg in crashes[:10])


def test_seeds_load_cleanly(shared_data):
    """The real files themselves load without any error (the harness is not vacuous)."""
    from maceq.mace.format import read_model
    from maceq.quant.prepare import prepare_graph

    m = read_model(shared_data / "mace_reference" / "fmnist_q8.yml")
    assert len(m.net_def.op) > 0 and m.arrays
    g, _, _ = prepare_graph(shared_data / "models" / "fmnist_mobilenet.onnx", input_shape=None)
    assert g.nodes


def test_mutations_are_deterministic():
    assert fuzz.mutations("config", 20) == fuzz.mutations("config", 20)
    assert fuzz.mutations("onnx_struct", 5) == fuzz.mutations("onnx_struct", 5)


def test_contract_flags_what_it_should():
    from maceq.errors import MaceqError

    def raises(exc):
        def f():
            raise exc
        return f

    fuzz._contract(raises(MaceqError("one line")))  # passes
    for bad in (MaceqError("two\nlines"), MaceqError(""), KeyError("k"), RecursionError()):
        with pytest.raises(fuzz.Crash):
            fuzz._contract(raises(bad))


def test_known_crashes_still_reproduce(shared_data, monkeypatch):
    """Every KNOWN entry has a reproducer that still crashes with exactly that signature."""
    monkeypatch.setattr(fuzz, "STRICT", True)
    repro = fuzz.known_reproducers()
    labels = {label.split(":")[0] for label in fuzz.KNOWN.values()}
    assert {k for k, _, _ in repro} == labels
    for label, target, data in repro:
        with pytest.raises(fuzz.Crash) as info:
            fuzz.TARGETS[target](data)
        sig = fuzz.signature(info.value)
        assert fuzz.KNOWN.get(sig, "").startswith(label + ":"), f"{label}: now {sig}"
