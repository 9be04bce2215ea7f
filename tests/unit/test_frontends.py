"""The Snakefile and dvc.yaml describe one DAG: same stages, commands, deps, outs and params."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import ROOT

# Loads the Snakefile through Snakemake's API in a child process (the Snakefile sets env vars).
DUMP_RULES = r"""
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import (ConfigSettings, OutputSettings, ResourceSettings,
                                      StorageSettings)
with SnakemakeApi(OutputSettings()) as api:
    wf = api.workflow(resource_settings=ResourceSettings(), config_settings=ConfigSettings(),
                      storage_settings=StorageSettings(), snakefile=Path("Snakefile"),
                      workdir=Path("."))._workflow
    rules = {}
    for r in wf.rules:
        if r.shellcmd is None:
            continue
        rules[r.name] = {
            "cmd": r.shellcmd.strip(),
            "deps": sorted(str(f) for f in r.input),
            "outs": sorted(str(f) for f in r.output),
            "params": sorted(k.replace("__", ".") for k in r.params.keys()),
            "log": [str(f) for f in r.log],
            "resources": {k: getattr(v, "value", v) for k, v in r.resources.items() if k == "gpus"},
            "values": {k.replace("__", "."): v for k, v in r.params.items()},
        }
    print("RULES" + json.dumps(rules))
"""


def snakemake_rules(repo=ROOT) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", DUMP_RULES], cwd=repo, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RULES"))
    return json.loads(line[len("RULES") :])


def _out_path(out) -> str:
    return next(iter(out)) if isinstance(out, dict) else out


def _persist(out) -> bool:
    return isinstance(out, dict) and bool(next(iter(out.values())).get("persist"))


def _expand(repo, deps: list[str]) -> list[str]:
    """dvc.yaml's code folders as the files Snakemake's code() helper lists for them."""
    out = []
    for dep in deps:
        path = repo / dep
        if dep.startswith("workflow/dsflow/") and path.is_dir():
            out += [str(f.relative_to(repo)) for f in path.rglob("*.py") if f.stat().st_size]
        else:
            out.append(dep)
    return out


def dvc_stages(repo=ROOT) -> dict:
    """Stages of dvc.yaml. Persistent outs (resume state) are listed apart: Snakemake deletes a
    job's outputs before running it, so the Snakefile must not declare them."""
    dvc = yaml.safe_load((repo / "dvc.yaml").read_text())
    stages = {}
    for name, st in dvc["stages"].items():
        outs = st.get("outs", []) + st.get("metrics", []) + st.get("plots", [])
        stages[name] = {
            "cmd": st["cmd"].strip(),
            "deps": sorted(_expand(repo, st.get("deps", []))),
            "outs": sorted(_out_path(o) for o in outs if not _persist(o)),
            "persist": sorted(_out_path(o) for o in outs if _persist(o)),
            "params": sorted(st.get("params", [])),
        }
    return stages


def differences(rules: dict, stages: dict) -> list[str]:
    diffs = []
    for name in sorted(set(rules) | set(stages)):
        if name not in rules or name not in stages:
            where = "dvc.yaml" if name not in stages else "Snakefile"
            diffs.append(f"{name}: missing from {where}")
            continue
        for field in ("cmd", "deps", "outs", "params"):
            if rules[name][field] != stages[name][field]:
                diffs.append(
                    f"{name}.{field}: Snakefile {rules[name][field]} != "
                    f"dvc.yaml {stages[name][field]}"
                )
        for out in stages[name]["persist"]:
            if out in rules[name]["outs"]:
                diffs.append(
                    f"{name}: persistent out {out} is a Snakemake output (deleted on rerun)"
                )
    return diffs


def test_snakefile_and_dvc_yaml_describe_the_same_dag():
    rules, stages = snakemake_rules(), dvc_stages()
    assert {
        "pretrained",
        "download",
        "tokenizer",
        "tokenize",
        "shard",
        "plan",
        "train",
        "evaluate",
        "report",
    } == set(stages)
    assert differences(rules, stages) == []
    assert stages["train"]["persist"] == ["checkpoints", "dvclive"]


def test_train_rule_declares_its_gpus(tmp_path):
    from conftest import copy_project, update_params

    # params.yaml's default device is auto with 3 ranks: the rule asks for 3 GPUs (on a cluster
    # the host that reads the workflow has none, its train nodes do: tests/e2e/test_slurm.py).
    assert snakemake_rules()["train"]["resources"] == {"gpus": 3}
    repo = copy_project(tmp_path / "repo")
    update_params(repo, {"train": {"device": "cuda"}})
    assert snakemake_rules(repo)["train"]["resources"] == {"gpus": 3}
    update_params(repo, {"train": {"device": "cpu"}})
    assert snakemake_rules(repo)["train"]["resources"] == {"gpus": 0}


def test_param_values_stay_short_and_change_with_their_section(tmp_path):
    from conftest import copy_project, update_params

    # Snakemake prints changed params in its reason line: no section as a 2 800-character repr.
    rules = snakemake_rules()
    for rule in rules.values():
        assert all(len(repr(v)) <= 40 for v in rule["values"].values()), rule["values"]
    seq_len = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["seq_len"]
    assert rules["evaluate"]["values"]["train.seq_len"] == seq_len  # a scalar as itself
    repo = copy_project(tmp_path / "repo")
    update_params(repo, {"train": {"optimizer": {"lr": 0.001}}})
    again = snakemake_rules(repo)
    assert again["train"]["values"]["train"] != rules["train"]["values"]["train"]
    assert again["train"]["values"]["model"] == rules["train"]["values"]["model"]


def test_every_command_is_a_dsflow_stage_and_every_rule_logs():
    for name, rule in snakemake_rules().items():
        assert rule["cmd"] == f"python -m dsflow {name}"
        assert rule["log"] == [f"logs/{name}.log"]


def test_drift_is_detected(tmp_path):
    stages = dvc_stages()
    rules = snakemake_rules()
    drifted = json.loads(json.dumps(stages))
    drifted["tokenizer"]["params"].append("seed")
    drifted["shard"]["cmd"] = "python -m dsflow shard --fast"
    del drifted["download"]
    drifted["train"]["outs"].remove("metrics/train.json")
    drifted["train"]["persist"].append("models/final")
    diffs = differences(rules, drifted)
    assert any(d.startswith("tokenizer.params") for d in diffs)
    assert any(d.startswith("shard.cmd") for d in diffs)
    assert "download: missing from dvc.yaml" in diffs
    assert any(d.startswith("train.outs") for d in diffs)
    assert any("persistent out models/final" in d for d in diffs)


def test_dvc_outs_are_the_paths_dsflow_names():
    """Every output dvc.yaml declares is a path of dsflow.paths, the one place that names them."""
    from dsflow import paths

    named = {str(v) for v in vars(paths).values() if isinstance(v, Path)}
    outs = {o for stage in dvc_stages().values() for o in stage["outs"] + stage["persist"]}
    assert sorted(outs - named) == []


# A string that is a run-directory path and nothing else (messages that mention one are not).
RUN_PATH = re.compile(r"^(data|models|checkpoints|reports|metrics|dvclive|logs)(/[\w.{}-]*)*/?$")


def run_paths(tree: ast.AST) -> list[ast.Constant]:
    """Run-directory paths spelled in `tree`: a string like "data/raw", or a bare top folder
    given to Path() or as a default argument ("logs" alone is also a word: a dict key, a
    profiler phase)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "/" in node.value and RUN_PATH.match(node.value):
                found.append(node)
            continue
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Path":
            args = node.args
        elif isinstance(node, ast.arguments):
            args = node.defaults + [d for d in node.kw_defaults if d is not None]
        else:
            continue
        found += [a for a in args if isinstance(a, ast.Constant) and RUN_PATH.match(str(a.value))]
    return found


def test_only_paths_py_spells_a_run_directory_path():
    spelled = []
    for path in sorted((ROOT / "workflow" / "dsflow").rglob("*.py")):
        if path.name != "paths.py":
            for node in run_paths(ast.parse(path.read_text())):
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert spelled == []
    # The check sees each spelling.
    code = 'a = Path("logs")\nb = open("data/raw/x.json")\nc = "data"\ndef f(d="dvclive"): pass'
    assert sorted(n.value for n in run_paths(ast.parse(code))) == [
        "data/raw/x.json",
        "dvclive",
        "logs",
    ]
