"""model.pretrained as a local folder or a Hub id: the pretrained stage's record, read offline from
a Hugging Face cache laid out here as snapshot_download leaves one, and the stages that read the
checkpoint (tokenizer, plan, train, export)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, copy_project, dsflow, run, tiny_run, update_params
from dsflow.atomic import write_json
from dsflow.errors import UsageError
from dsflow.model import source
from dsflow.paths import PRETRAINED

REPO_ID = "dsflow-test/tiny-deepseek"
COMMIT_A = hashlib.sha1(b"first").hexdigest()
COMMIT_B = hashlib.sha1(b"second").hexdigest()
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
VOCAB = 400  # padded past the tokenizer's ids, as DeepSeek pads its embeddings
FILES = ["config.json", "generation_config.json", "model.safetensors"]
FILES += ["tokenizer.json", "tokenizer_config.json"]


def deepseek_like_tokenizer(out: Path) -> None:
    """A byte-level BPE saved as DeepSeek's are: specials named like theirs, and BOS asked for by
    tokenizer_config.json (add_bos_token), not by a template in tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["Once upon a time, a little cat sat on a mat."] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS}
    config.update(legacy=True, tokenizer_class="LlamaTokenizerFast", unk_token=None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_checkpoint(out: Path, seed: int) -> Path:
    """A random tiny deepseek_v3 model (save_pretrained) with the tokenizer above."""
    import torch

    from dsflow.model.build import build_model
    from dsflow.model.presets import model_config

    torch.manual_seed(seed)
    build_model(model_config("tiny", VOCAB), device_type="cpu").save_pretrained(out)
    deepseek_like_tokenizer(out)
    return out


def cached_repo(hf_home: Path, repo_id: str) -> Path:
    return hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"


def lay_out_cache(hf_home: Path, repo_id: str, commits: dict[str, Path], refs: dict) -> None:
    """What snapshot_download leaves under HF_HOME: blobs/<hash> (sha256 for LFS files, else the
    git blob id), snapshots/<commit>/<file> -> ../../blobs/<hash>, refs/<branch or tag>."""
    repo = cached_repo(hf_home, repo_id)
    (repo / "blobs").mkdir(parents=True)
    for commit, folder in commits.items():
        (repo / "snapshots" / commit).mkdir(parents=True)
        for file in sorted(folder.iterdir()):
            data = file.read_bytes()
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            if file.suffix in (".safetensors", ".bin"):
                blob = hashlib.sha256(data).hexdigest()
            (repo / "blobs" / blob).write_bytes(data)
            (repo / "snapshots" / commit / file.name).symlink_to(f"../../blobs/{blob}")
    for ref, commit in refs.items():
        set_ref(hf_home, repo_id, ref, commit)


def set_ref(hf_home: Path, repo_id: str, ref: str, commit: str) -> None:
    path = cached_repo(hf_home, repo_id) / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commit)


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> SimpleNamespace:
    """Two commits of a tiny checkpoint in a Hugging Face cache (main and tag v1 at the first,
    branch dev at the second), and a checkpoint with pickled weights only."""
    root = tmp_path_factory.mktemp("hub")
    a = tiny_checkpoint(root / "a", seed=0)
    b = tiny_checkpoint(root / "b", seed=1)
    pickled = root / "pickled"
    pickled.mkdir()
    shutil.copy(a / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"a pickle: never fetched, never loaded")
    home = root / "hf"
    lay_out_cache(home, REPO_ID, {COMMIT_A: a, COMMIT_B: b}, {"main": COMMIT_A, "v1": COMMIT_A})
    set_ref(home, REPO_ID, "dev", COMMIT_B)
    lay_out_cache(home, "dsflow-test/pickled", {COMMIT_A: pickled}, {"main": COMMIT_A})
    llama = root / "llama"  # a checkpoint of a family dsflow does not train
    shutil.copytree(a, llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    lay_out_cache(home, "dsflow-test/llama", {COMMIT_A: llama}, {"main": COMMIT_A})
    return SimpleNamespace(home=home, a=a, b=b, llama=llama)


def offline(hf_home: Path) -> dict:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def params_only(path: Path, model: dict) -> Path:
    """A folder with params.yaml only: all the pretrained stage reads."""
    path.mkdir(parents=True)
    shutil.copy(ROOT / "params.yaml", path)
    update_params(path, {"model": model})
    return path


def record(repo: Path, hf_home: Path, **model) -> dict:
    update_params(repo, {"model": model})
    dsflow("pretrained", cwd=repo, env=offline(hf_home))
    return json.loads((repo / PRETRAINED).read_text())


def test_a_hub_id_resolves_offline_by_branch_tag_and_commit(hub, tmp_path):
    repo = params_only(tmp_path / "repo", {"pretrained": REPO_ID})
    first = record(repo, hub.home, revision=None)
    assert first["commit"] == COMMIT_A == record(repo, hub.home, revision="v1")["commit"]
    assert record(repo, hub.home, revision="dev")["commit"] == COMMIT_B
    assert record(repo, hub.home, revision=COMMIT_B)["commit"] == COMMIT_B
    # The files a load reads, by name and size: the commit pins their content.
    assert [f["name"] for f in first["files"]] == FILES
    weights = (hub.a / "model.safetensors").read_bytes()
    assert first["files"][2] == {"name": "model.safetensors", "size": len(weights)}
    # The same bytes on a rerun and from another cache: no path of this machine in them.
    assert record(repo, hub.home, revision=None) == first
    once = (repo / PRETRAINED).read_bytes()
    other = tmp_path / "elsewhere/hf"
    shutil.copytree(hub.home, other, symlinks=True)
    copies = tmp_path / "copies/hf"  # a cache without symlinks (copied with cp -rL)
    shutil.copytree(hub.home, copies, symlinks=False)
    for home in (hub.home, other, copies):
        dsflow("pretrained", cwd=repo, env=offline(home))
        assert (repo / PRETRAINED).read_bytes() == once
    assert str(tmp_path).encode() not in once and str(hub.home).encode() not in once
    log = (repo / "logs/pretrained.log").read_text()
    assert f"model.pretrained {REPO_ID}: commit {COMMIT_A}, 5 files" in log


@pytest.mark.parametrize(
    "model, says",
    [
        (
            {"pretrained": REPO_ID, "revision": "v9"},
            "model.revision: 'v9' of dsflow-test/tiny-deepseek is not in the Hugging Face cache",
        ),
        (
            {"pretrained": "dsflow-test/absent"},
            "model.pretrained: dsflow-test/absent is no local folder and not in the Hugging Face",
        ),
        (
            {"pretrained": "dsflow-test/pickled"},
            "has pickled weights only (pytorch_model.bin); dsflow loads safetensors only",
        ),
        ({"pretrained": "no/such/folder"}, "model.pretrained: 'no/such/folder' is no folder"),
        ({"revision": "main"}, "model.revision: 'main' names a revision but model.pretrained"),
        ({"pretrained": ".", "revision": "main"}, "model.revision: 'main' is set but"),
        ({"pretrained": "."}, "model.pretrained: . has no config.json"),
        ({"pretrained": "llama"}, "model.pretrained: llama has model_type 'llama'; dsflow trains"),
        (
            {"pretrained": "dsflow-test/llama"},
            f"model.pretrained: dsflow-test/llama@{COMMIT_A} has model_type 'llama'",
        ),
    ],
    ids=[
        "revision",
        "id",
        "pickles",
        "no-such",
        "no-pretrained",
        "folder-revision",
        "no-config",
        "other-family",
        "other-family-hub",
    ],
)
def test_bad_input_is_one_line_naming_the_key(hub, tmp_path, model, says):
    repo = params_only(tmp_path / "repo", model)
    if model.get("pretrained") == "llama":
        shutil.copytree(hub.llama, repo / "llama")
    proc = dsflow("pretrained", cwd=repo, check=False, env=offline(hub.home))
    line = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in line and says in line, line
    assert not (repo / PRETRAINED).exists()
    if model.get("revision") == "v9":  # what the cache holds instead
        assert "(it holds dev, main, v1, commit " in line
        assert f"commit {COMMIT_A[:12]}" in line and f"commit {COMMIT_B[:12]}" in line
    if model.get("pretrained") == "dsflow-test/absent":  # what to set
        for fix in ("HF_HUB_OFFLINE", "HF_HOME", "a local folder"):
            assert fix in line


def test_a_local_folder_is_hashed_once_and_recorded_by_content(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hub.a, "ck")
    real, read = source.sha256_file, []
    monkeypatch.setattr(source, "sha256_file", lambda p: read.append(Path(p).name) or real(p))
    model = {"pretrained": "ck", "revision": None}
    first = source.resolve(model)
    assert sorted(read) == FILES and [f["name"] for f in first["files"]] == FILES
    read.clear()
    assert source.resolve(model) == first and read == []
    # Touched, not changed: read again, the same record.
    stat = os.stat("ck/config.json")
    os.utime("ck/config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert source.resolve(model) == first and read == ["config.json"]
    read.clear()
    shutil.copy(hub.b / "model.safetensors", "ck/model.safetensors")
    changed = source.resolve(model)
    assert read == ["model.safetensors"] and changed["sha256"] != first["sha256"]
    # The train stage takes the folder the record describes, and refuses one changed since.
    write_json(PRETRAINED, changed)
    assert source.resolved(model)["source"]["sha256"] == changed["sha256"]
    write_json(PRETRAINED, first)
    with pytest.raises(UsageError, match="model.pretrained: ck changed since data/pretrained"):
        source.resolved(model)


@pytest.fixture
def cache(hub, monkeypatch):
    """huggingface_hub in this process reads the laid-out cache, offline (HF_HOME and
    HF_HUB_OFFLINE are read when it is imported: the constants they set, patched)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub.home


def test_train_plan_and_export_read_the_hub_checkpoint(cache, hub, prepared, tmp_path, monkeypatch):
    from dsflow import params as params_mod
    from dsflow.model.build import build_model
    from dsflow.model.build import load_checkpoint_config as net_config
    from dsflow.plan import request
    from dsflow.train import engine
    from dsflow.train import stage as train
    from dsflow.train.runspec import RunSpec

    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo)
    monkeypatch.chdir(repo)
    overlay = {**tiny_run(1, 2, zero_stage=2), "model": {"preset": "tiny", "pretrained": REPO_ID}}
    params = params_mod.validate(params_mod.deep_merge(params_mod.load(), overlay))
    snapshots = cached_repo(cache, REPO_ID) / "snapshots"
    assert source.folder(params["model"]) == snapshots / COMMIT_A
    # The plan: the checkpoint's own config (its padded vocabulary, not the tokenizer's 384).
    req = request.resolve(params, None, world=1)
    assert req.vocab_size == VOCAB and req.vocab_source == f"model.pretrained {REPO_ID}"
    # The run spec: the snapshot folder for the ranks, the commit for the fingerprint.
    spec = train.resolve_run(params)
    model = spec["params"]["model"]
    assert model["pretrained"] == str(snapshots / COMMIT_A)
    assert model["source"]["commit"] == COMMIT_A and spec["vocab_size"] == 384
    net = engine._model(RunSpec.from_files(spec, spec["ds_config"]), "cpu").state_dict()
    ref = build_model(net_config(hub.a), device_type="cpu", pretrained=str(hub.a)).state_dict()
    assert ref.keys() == net.keys() and all(net[k].equal(v) for k, v in ref.items())
    # Another cache, another folder: the same run.
    other = tmp_path / "other-hf"
    shutil.copytree(cache, other, symlinks=True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(other / "hub"))
    again = train.resolve_run(params)
    assert again["params"]["model"]["pretrained"].startswith(str(other))
    assert again["fingerprint"] == spec["fingerprint"]
    # The recorded commit wins over where the branch points now; export finds a moved folder.
    elsewhere = other / snapshots.relative_to(cache)
    write_json(PRETRAINED, {"pretrained": REPO_ID, "revision": None, "commit": COMMIT_B})
    assert source.folder(params["model"]) == elsewhere / COMMIT_B
    moved = {**model, "pretrained": str(tmp_path / "gone")}
    assert source.folder(moved) == elsewhere / COMMIT_A
    # A rank on another node gets node 0's folder in run.json: it loads the commit from its own
    # cache instead.
    moved_spec = RunSpec.from_files({**spec, "params": {**spec["params"], "model": moved}}, {})
    assert engine.base_folder(moved_spec) == str(elsewhere / COMMIT_A)


def test_the_tokenizer_stage_copies_the_checkpoints_tokenizer(hub, prepared, tmp_path):
    from transformers import AutoTokenizer

    from dsflow.data import tokenizing

    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo)
    update_params(repo, {"model": {"pretrained": REPO_ID}})
    for stage in ("pretrained", "tokenizer"):
        dsflow(stage, cwd=repo, env=offline(hub.home))
    tok = AutoTokenizer.from_pretrained(repo / "data/tokenizer")
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(hub.a).get_vocab()
    config = json.loads((repo / "data/tokenizer/tokenizer_config.json").read_text())
    assert "local_files_only" not in config  # the same bytes offline as online
    # BOS as the checkpoint's tokenizer_config.json asks (add_bos_token), in a plain client...
    bos, eos = tok.convert_tokens_to_ids([BOS, EOS])
    assert tok("Once upon a time")["input_ids"][0] == bos and tok.eos_token == EOS
    # ...and in the tokenize stage: BOS first, the text, one EOS.
    tokenizing.init_worker(str(repo / "data/tokenizer/tokenizer.json"), eos)
    ids, counts = tokenizing.encode_texts(["Once upon a time", "a cat"])
    first = ids[: counts[0]].tolist()
    assert first[0] == bos and first[-1] == eos and first[1:-1].count(eos) == 0
    assert tok.decode(first[1:-1]) == "Once upon a time"


def test_a_tokenizer_whose_ids_the_checkpoint_lacks_is_refused(prepared, tmp_path):
    from transformers import AutoTokenizer

    from dsflow.data.tokenizer import check_fits_checkpoint
    from dsflow.model.presets import model_config

    small = tmp_path / "small"
    model_config("tiny", 300).save_pretrained(small)
    tok = AutoTokenizer.from_pretrained(prepared / "data/tokenizer")  # ids up to 383
    with pytest.raises(UsageError) as exc:
        check_fits_checkpoint(tok, {"pretrained": str(small), "revision": None})
    line = str(exc.value)
    assert "tokenizer.pretrained / model.pretrained" in line and "up to 383" in line
    assert "vocab_size 300" in line
    model_config("tiny", 384).save_pretrained(small)
    check_fits_checkpoint(tok, {"pretrained": str(small), "revision": None})


def dvc_status(repo: Path) -> dict:
    """{stage: what changed} for the stages `dvc status` finds out of date."""
    out = run(["dvc", "status", "--json"], cwd=repo).stdout
    return {name.split(":")[-1]: why for name, why in json.loads(out).items()}


def test_dvc_reruns_train_when_the_branch_moves_and_not_otherwise(hub, tmp_path):
    """A real DVC project from the repository's dvc.yaml: the pretrained stage really runs; the
    other stages' outputs are stand-ins, committed, since only DVC's decisions are tested."""
    home = tmp_path / "hf"
    shutil.copytree(hub.home, home, symlinks=True)
    env = offline(home)
    repo = copy_project(tmp_path / "repo")
    update_params(repo, {"model": {"pretrained": REPO_ID}})
    run(["git", "init", "-q"], cwd=repo)
    run(["git", "add", "-A"], cwd=repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], cwd=repo)
    run(["dvc", "repro", "pretrained"], cwd=repo, env=env)
    for out in ("data/raw", "data/tokenizer", "data/tokens", "data/shards", "models/final"):
        (repo / out).mkdir(parents=True)
        (repo / out / "x").write_text(out)
    for out in ("reports/plan.json", "metrics/train.json", "checkpoints/x", "dvclive/x"):
        (repo / out).parent.mkdir(parents=True, exist_ok=True)
        (repo / out).write_text(out)
    run(["dvc", "commit", "-f", "-d", "train"], cwd=repo)
    assert "train" not in dvc_status(repo)
    # Resolved again, the branch where it was: the same record, nothing to rerun.
    run(["dvc", "repro", "-f", "-s", "pretrained"], cwd=repo, env=env)
    assert "train" not in dvc_status(repo)
    # The branch moved: the stages that read the checkpoint rerun, training among them.
    set_ref(home, REPO_ID, "main", COMMIT_B)
    run(["dvc", "repro", "-f", "-s", "pretrained"], cwd=repo, env=env)
    changed = dvc_status(repo)
    assert {"tokenizer", "plan", "train"} <= set(changed)
    assert {"changed deps": {"data/pretrained.json": "modified"}} in changed["train"]
    dry = run(["dvc", "repro", "--dry", "train"], cwd=repo, env=env).stdout
    assert "Running stage 'train'" in dry
    # Another revision is another params value: the stage reruns with the ones after it.
    update_params(repo, {"model": {"revision": "v1"}})
    assert {"pretrained", "tokenizer", "train"} <= set(dvc_status(repo))


def test_a_hub_tokenizer_keeps_its_bos_flag(cache, hub):
    """tokenizer.pretrained as a Hub id: add_bos_token comes from the cached
    tokenizer_config.json, as for a folder (transformers 5 would drop it otherwise)."""
    from dsflow.data.tokenizer import special_token_flags

    assert special_token_flags(REPO_ID) == special_token_flags(str(hub.a))
    assert special_token_flags(REPO_ID).get("add_bos_token") is True
