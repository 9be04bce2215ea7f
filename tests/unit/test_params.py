import pytest
import yaml

from conftest import ROOT, dsflow
from dsflow import params as params_mod
from dsflow.errors import UsageError


def test_params_yaml_is_valid_and_sets_every_knob():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    filled = params_mod.validate(raw)
    # params.yaml must name every key the schema knows, so DVC can track each one.
    assert params_mod.flatten(raw).keys() == params_mod.flatten(filled).keys()


@pytest.mark.parametrize(
    "overlay, key, allowed",
    [
        ({"tokenizer": {"vocab_size": "big"}}, "tokenizer.vocab_size", "integer"),
        ({"tokenizer": {"vocab_size": 0}}, "tokenizer.vocab_size", ">= 1"),
        ({"download": {"source": "ftp"}}, "download.source", '"builtin", "hf", "files"'),
        ({"download": {"val_fraction": 0.9}}, "download.val_fraction", "<= 0.5"),
        (
            {"tokenizer": {"vocab": 3}},
            "tokenizer.vocab",
            "min_frequency, pretrained, sample_bytes, vocab_size",
        ),
        ({"bogus": 1}, "bogus", "download"),
        ({"download": {"hf": {"path": ""}}}, "download.hf.path", "at least 1 character"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(overlay, key, allowed):
    raw = params_mod.deep_merge(yaml.safe_load((ROOT / "params.yaml").read_text()), overlay)
    with pytest.raises(UsageError) as exc:
        params_mod.validate(raw)
    msg = str(exc.value)
    assert "\n" not in msg
    assert key in msg and allowed in msg


def test_defaults_are_filled_from_the_schema():
    sections = ("download", "tokenizer", "tokenize", "shard", "model", "train", "evaluate")
    filled = params_mod.validate({"seed": 1, **{s: {} for s in sections}})
    assert filled["tokenizer"]["vocab_size"] == 4096
    assert filled["download"]["hf"]["split"] == "train"


def test_cli_reports_bad_params_in_one_line(project):
    (project / "params.yaml").write_text("seed: -3\n")
    proc = dsflow("download", cwd=project, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "seed" in lines[0] and ">= 0" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (project / "data" / "raw").exists()


def test_malformed_yaml_names_file_and_line(project):
    (project / "params.yaml").write_text("seed: 1\ndownload: [unclosed\n")
    proc = dsflow("validate", cwd=project, check=False)
    assert proc.returncode == 2
    assert "params.yaml" in proc.stderr and "line" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_profiles_are_valid_overlays():
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    profiles = sorted((ROOT / "profiles").glob("*.yaml"))
    assert {"rtx4090x3.yaml", "tinystories.yaml"} <= {p.name for p in profiles}
    for profile in profiles:
        params_mod.validate(
            params_mod.deep_merge(base, params_mod.read_yaml(profile)), source=profile.name
        )


def test_profile_overlay_via_env_and_flag(project):
    out = dsflow("--profile", "profiles/tinystories.yaml", "validate", cwd=project).stdout
    assert yaml.safe_load(out)["download"]["source"] == "hf"
    env = {params_mod.PROFILES_ENV: "profiles/tinystories.yaml"}
    out = dsflow("validate", cwd=project, env=env).stdout
    assert yaml.safe_load(out)["download"]["source"] == "hf"


def test_profile_as_dvc_set_arguments(project):
    out = dsflow("profile", "profiles/tinystories.yaml", cwd=project).stdout
    assert "-S 'download.source=\"hf\"'" in out
