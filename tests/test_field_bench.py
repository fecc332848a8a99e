"""`kernels.py field` on the CPU: each argument mapping onto a field library's kernel, fed the
project's inputs, equals the project's own entry point (float64, references of the libraries'
documented semantics in the kernels' places); a wrong mapping is caught and never timed; a library
that does not import is reported in one line, and one whose package __init__ fails still lends its
kernel."""
import json
import sys

import pytest
import torch

from benchmarks import kernels
from benchmarks.kernel_benches import field


@pytest.fixture(scope="module")
def smoke_rows():
    return {row["path"]: row for row in field.smoke_checks()}


@pytest.mark.parametrize("path", ["mamba_chunk_scan_combined", "chunk_simple_gla",
                                  "mamba_chunk_scan_combined dt_softplus", "causal_conv1d_fn",
                                  "torch sdpa, flash backend", "flash_attn_func"])
def test_mapping_equals_the_projects_own_call(smoke_rows, path):
    row = smoke_rows[path]
    bad = {k: v for part in ("forward", "backward") for k, v in row[part].items() if not v["close"]}
    assert row["forward_matches"] and row["backward_matches"], bad
    # every output and every gradient was compared (the scan: y, final state, 7 or 8 inputs)
    assert row["forward"] and row["backward"]


def scan_case():
    return field.scan_cases(field.SMOKE_DIMS, torch.device("cpu"), torch.float64,
                            field.reference_kernels())[0]


def test_wrong_mappings_are_caught():
    case = scan_case()
    # fla's default scale K^-0.5 instead of 1: the outputs differ
    wrong = field.bound(lambda k, *a: field.gla_mapped(k, *a, scale=None), field.simple_gla_reference,
                        field.SMOKE_DIMS["ssd_chunk"])
    check = field.compare(wrong, case.own[1], case, 1e-9)
    assert not check["forward_matches"] and not check["forward"]["out0"]["close"]
    # SDPA's is_causal aligns the mask to the top left: queries miss the chunk's last keys
    att = field.attention_case(field.SMOKE_DIMS, torch.device("cpu"), torch.float64,
                               field.reference_kernels())
    check = field.compare(lambda *a: field.sdpa_mapped(*a, lower_right=False), att.own[1], att, 1e-9)
    assert not check["forward_matches"]


def test_run_case_times_only_what_matches_and_names_what_is_missing():
    kernels = field.reference_kernels()
    kernels["fla"] = (lambda *a, **k: field.simple_gla_reference(*a, **{**k, "scale": None}), {})
    kernels["causal_conv1d"] = (None, {"not_installed": "ModuleNotFoundError: No module named 'x'"})
    cpu = torch.device("cpu")
    cases = field.cases_for(["scan", "conv"], field.SMOKE_DIMS, cpu, torch.float64, kernels)
    rows = {r["path"]: r for c in cases for r in field.run_case(c, "tiny", cpu, 1e-9, 1, 0, False)}
    own = rows["elephant ssd_scan (PyTorch)"]
    assert own["fwd_ms"] > 0 and own["fwd_bwd_ms"] > 0
    good = rows["mamba_chunk_scan_combined"]
    assert good["matches"] and good["fwd_ms"] > 0 and good["fwd_vs_own"] > 0
    bad = rows["chunk_simple_gla"]
    assert bad["matches"] is False and "not_timed" in bad and "fwd_ms" not in bad
    assert rows["causal_conv1d_fn"] == {"recipe": "tiny", "op": "causal depthwise conv",
                                        "path": "causal_conv1d_fn", "library": "causal_conv1d",
                                        "not_installed": "ModuleNotFoundError: No module named 'x'"}
    json.dumps(list(rows.values()))   # the report's rows are plain JSON


def test_missing_library_is_reported_in_one_line(monkeypatch):
    monkeypatch.setitem(field.LIBRARIES, "nowhere", ("no_such_package_72.ops", "kernel", "nope"))
    kernel, info = field.import_kernel("nowhere")
    assert kernel is None
    assert info["not_installed"] == "ModuleNotFoundError: No module named 'no_such_package_72'"


def test_kernel_of_a_package_whose_init_fails_still_imports(tmp_path, monkeypatch):
    # mamba-ssm's case: its __init__ imports a CUDA extension that a Triton-only wheel lacks
    pkg = tmp_path / "fieldpkg72"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import no_cuda_extension_72\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "scan.py").write_text("def scan(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fieldpkg72", "fieldpkg72.ops", "fieldpkg72.ops.scan"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(field.LIBRARIES, "fieldpkg72", ("fieldpkg72.ops.scan", "scan", "fieldpkg72"))
    kernel, info = field.import_kernel("fieldpkg72")
    assert kernel is not None and kernel(1) == 2
    assert info["package_init_skipped"] == "ModuleNotFoundError: No module named 'no_cuda_extension_72'"
    for name in ("fieldpkg72", "fieldpkg72.ops", "fieldpkg72.ops.scan"):
        sys.modules.pop(name, None)


def test_cli_smoke_writes_its_report(tmp_path, capsys):
    out = tmp_path / "field.json"
    assert kernels.main(["field", "--cpu-smoke", "--ops", "conv,attention", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["path"] for r in report["rows"]} == {"causal_conv1d_fn", "torch sdpa, flash backend",
                                                   "flash_attn_func"}
    assert set(report["libraries"]) == set(field.LIBRARIES) and report["commit"]
    for info in report["libraries"].values():   # a version, or one line saying why not
        assert "version" in info or "\n" not in info["not_installed"]
    assert "matches" in capsys.readouterr().out


def test_cli_refuses_an_unknown_op():
    with pytest.raises(SystemExit, match="--ops"):
        kernels.main(["field", "--cpu-smoke", "--ops", "scan,mlp"])
