"""Where the checkpoint to continue from comes from: `model.pretrained` as a local folder or a Hub
id (org/name, at `model.revision`), and the record the pretrained stage keeps of it.

A Hub id goes through huggingface_hub's cache (HF_HOME, HF_HUB_OFFLINE): `snapshot_download`
fetches the configs, the tokenizer and the safetensors weights, never pickled weights nor the
repository's Python, and only what the cache lacks; a warm cache works offline. Its record names
the commit and each file's blob hash as the cache already knows it (nothing is re-hashed), and no
path of this machine: the same commit gives the same bytes on every machine. A local folder is
recorded by a content hash of its files; `PRETRAINED_HASHES` caches each file's hash by (size,
mtime_ns), so a rerun reads only the files that changed.

The stages that read the checkpoint call `folder` (its local folder) or, for the train stage,
`resolved`. Both take the commit from the record when it describes the same model.pretrained and
model.revision, and neither downloads.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from dsflow.atomic import sha256_file, write_json
from dsflow.errors import UsageError
from dsflow.model.presets import FAMILIES
from dsflow.paths import PRETRAINED, PRETRAINED_HASHES
from dsflow.progress import log

# What loading a checkpoint reads. Pickles (*.bin, *.pt) can run code when loaded, and a Hub
# repository's *.py is remote code: neither is fetched nor read.
ALLOW = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensors to files
FOLDER_FIX = "give the checkpoint's folder or a Hub id (org/name)"


def is_hub_id(name: str) -> bool:
    """True for an org/name Hub id, False for an existing folder; else a one-line error."""
    path = Path(name).expanduser()
    if path.is_dir():
        return False
    if path.exists():
        raise UsageError(f"model.pretrained: {name} is a file; {FOLDER_FIX}")
    if HUB_ID.fullmatch(name):
        return True
    raise UsageError(f"model.pretrained: {name!r} is no folder and no Hub id; {FOLDER_FIX}")


def resolve(model: dict, *, download: bool = False) -> dict:
    """The record of model.pretrained: a Hub id's commit and files (`download`: fetch what the
    cache lacks), a local folder's files and content hash, or a record saying it is unset."""
    name, revision = model.get("pretrained"), model.get("revision")
    if not name:
        return {"pretrained": None, "revision": None}
    if not is_hub_id(name):
        _check_no_revision(name, revision)
        return folder_record(name)
    if download:  # config.json first: another family's checkpoint stops before its weights come
        head = snapshot(name, revision, download=True, patterns=["config.json"])
        check_family(f"{name}@{head.name}", head)
    return hub_record(name, revision, snapshot(name, revision, download=download))


def _check_no_revision(name: str, revision: str | None) -> None:
    if revision is not None:
        raise UsageError(
            f"model.revision: {revision!r} is set but model.pretrained {name} is a local folder; "
            "a revision names a Hub id's branch, tag or commit: set model.revision: null"
        )


def hub_record(repo_id: str, revision: str | None, snapshot_dir: Path) -> dict:
    """A snapshot's commit and files (name and size), no path of this machine. The commit pins
    every file's content; a per-file hash would differ between a cache of symlinked blobs (git
    blob ids for small files) and one of copies."""
    names = loadable(snapshot_dir)
    check_weights(f"{repo_id}@{snapshot_dir.name}", snapshot_dir, names, repo_id)
    check_family(f"{repo_id}@{snapshot_dir.name}", snapshot_dir)
    files = [{"name": n, "size": (snapshot_dir / n).stat().st_size} for n in names]
    return {
        "pretrained": repo_id,
        "revision": revision,
        "commit": snapshot_dir.name,
        "files": files,
    }


def loadable(root: Path) -> list[str]:
    """The files of `root` that a load reads (ALLOW), as sorted relative names; hidden ones
    (.cache/, .git/) left out."""
    from huggingface_hub.utils import filter_repo_objects

    names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    names = [n for n in names if not any(part.startswith(".") for part in n.split("/"))]
    return sorted(filter_repo_objects(names, allow_patterns=ALLOW))


def check_weights(where: str, root: Path, names: list[str], repo_id: str | None = None) -> None:
    """One line unless `root` holds a config.json and complete safetensors weights: every shard
    its index names, else at least one file. Pickled weights alone are refused (`repo_id`: a
    snapshot of that Hub repository, whose pickles were never fetched)."""
    if "config.json" not in names:
        raise UsageError(f"model.pretrained: {where} has no config.json; {FOLDER_FIX}")
    weights = {n for n in names if n.endswith(".safetensors")}
    if (root / INDEX).is_file():
        shards = weight_files(where, root)
        missing = sorted(set(shards) - weights)
        if missing:
            raise UsageError(
                f"model.pretrained: {where} lacks {len(missing)} of the {len(shards)} weight "
                f"files its {INDEX} names ({missing[0]}); complete the folder (a Hub id: "
                "rerun the pretrained stage with network access)"
            )
    elif not weights:
        from huggingface_hub.utils import filter_repo_objects

        every = [p.relative_to(root).as_posix() for p in root.rglob("*")]
        every += _cached_tree(repo_id, root.name) if repo_id else []
        pickles = list(filter_repo_objects(every, allow_patterns=PICKLES))
        what = f"pickled weights only ({pickles[0]})" if pickles else "no *.safetensors weights"
        raise UsageError(
            f"model.pretrained: {where} has {what}; dsflow loads safetensors only (pickles can "
            "run code): use a checkpoint with *.safetensors, or save it with "
            "save_pretrained(..., safe_serialization=True)"
        )


def weight_files(where: str, root: Path) -> list[str]:
    """The safetensors files a load reads, as transformers finds them: every shard the index
    names, else model.safetensors (none when it is not there: check_weights says why)."""
    if not (root / INDEX).is_file():
        return ["model.safetensors"] if (root / "model.safetensors").is_file() else []
    try:
        return sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        detail = " ".join(str(exc).split())[:200]
        raise UsageError(f"model.pretrained: {where}: {INDEX} is unreadable ({detail})") from None


def check_family(where: str, root: Path) -> None:
    """One line unless config.json names a model_type dsflow trains: the pretrained stage is the
    first to read the checkpoint, so a Llama or Qwen folder stops here, not in the tokenizer or
    train stage after a download."""
    try:
        model_type = json.loads((root / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise UsageError(f"model.pretrained: {where}: config.json is unreadable") from None
    refuse_other_family(where, model_type)


def refuse_other_family(where: str, model_type: Any) -> None:
    """One line unless `model_type` is a family dsflow trains (presets.FAMILIES)."""
    if model_type not in FAMILIES:
        raise UsageError(
            f"model.pretrained: {where} has model_type {model_type!r}; dsflow trains "
            f"{' and '.join(map(repr, FAMILIES))} checkpoints (DeepSeek-V2, V2-Lite, V3, "
            "Moonlight and their fine-tunes)"
        )


def _cached_tree(repo_id: str, commit: str) -> list[str]:
    """Every file of a commit as the cache's tree listing names it (what was not fetched too)."""
    from huggingface_hub import get_cached_repo_tree

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit)]
    except Exception:  # noqa: BLE001 - no listing cached (it is written online)
        return []


def snapshot(
    repo_id: str, revision: str | None, *, download: bool, patterns: list[str] = ALLOW
) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (None: main) in huggingface_hub's
    cache; with `download`, the files of `patterns` the cache lacks are fetched first (online)."""
    from huggingface_hub import errors, snapshot_download

    rev = revision or "main"
    try:
        path = snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, local_files_only=not download
        )
    except errors.RevisionNotFoundError:
        raise UsageError(
            f"model.revision: {rev!r} does not exist in {repo_id} on the Hub; name one of its "
            "branches, tags or commits"
        ) from None
    except errors.RepositoryNotFoundError:  # and GatedRepoError
        raise UsageError(
            f"model.pretrained: {repo_id} is no local folder, and on the Hub no repository or a "
            "private or gated one: check the id, or accept its terms and log in (hf auth login, "
            "or HF_TOKEN)"
        ) from None
    except errors.LocalEntryNotFoundError as e:  # offline, unreachable, or not downloading
        incomplete = isinstance(e, errors.IncompleteSnapshotError)
        raise UsageError(not_cached(repo_id, rev, download, incomplete)) from None
    except (errors.HfHubHTTPError, OSError, ValueError) as e:  # ValueError: a malformed id
        detail = " ".join(str(e).split())[:300]
        raise UsageError(f"model.pretrained: {repo_id}@{rev}: {detail}") from None
    return Path(path)


def not_cached(repo_id: str, rev: str, download: bool, incomplete: bool = False) -> str:
    """Why `repo_id` at `rev` is not at hand, and what to set, in one line."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE)
    if not download:
        why = "and only the pretrained stage downloads: run it first (python -m dsflow pretrained)"
    elif constants.HF_HUB_OFFLINE:
        why = "and HF_HUB_OFFLINE is set"
    else:
        why = "and the Hub cannot be reached"
    if incomplete:
        return (
            f"model.pretrained: the cached snapshot of {repo_id}@{rev} in {cache} is partial {why}"
        )
    held = cached_revisions(cache / f"models--{repo_id.replace('/', '--')}")
    if held and not download:  # the revision may be the commit data/pretrained.json recorded
        return (
            f"model.pretrained: {repo_id}@{rev} (model.revision, or the commit {PRETRAINED} "
            f"recorded) is not in the Hugging Face cache {cache} (it holds {', '.join(held)}) {why}"
        )
    if held:
        return (
            f"model.revision: {rev!r} of {repo_id} is not in the Hugging Face cache {cache} "
            f"(it holds {', '.join(held)}) {why}; set model.revision to one of those"
        )
    if not download:
        return f"model.pretrained: {repo_id}@{rev} is not in the Hugging Face cache {cache} {why}"
    return (
        f"model.pretrained: {repo_id} is no local folder and not in the Hugging Face cache "
        f"{cache} {why}: download it once with network access (unset HF_HUB_OFFLINE), set "
        "HF_HOME to a cache that holds it, or set model.pretrained to a local folder"
    )


def cached_revisions(repo_dir: Path) -> list[str]:
    """The branches and tags (refs) and the commits (snapshots) a cached repository holds."""
    refs = repo_dir / "refs"
    names = sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file())
    snapshots = repo_dir / "snapshots"
    commits = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    return names + [f"commit {c[:12]}" for c in commits]


def folder_record(name: str) -> dict:
    """A local folder's files (name, size, sha256) and one hash of them all."""
    root = Path(name).expanduser()
    names = loadable(root)
    check_weights(name, root, names)
    check_family(name, root)
    hashes = file_hashes(root, names)
    files = [{"name": n, "size": hashes[n][0], "sha256": hashes[n][2]} for n in names]
    digest = hashlib.sha256(json.dumps([[f["name"], f["sha256"]] for f in files]).encode())
    return {"pretrained": name, "revision": None, "sha256": digest.hexdigest(), "files": files}


def file_hashes(root: Path, names: list[str]) -> dict[str, list]:
    """{name: [size, mtime_ns, sha256]}: a file the hash cache holds with the same size and
    mtime is not read again."""
    key = str(root.resolve())
    try:
        known = json.loads(PRETRAINED_HASHES.read_text()).get(key, {})
    except (OSError, ValueError, AttributeError):
        known = {}
    hashes, read = {}, []
    for name in names:
        stat = (root / name).stat()
        old = known.get(name)
        if isinstance(old, list) and old[:2] == [stat.st_size, stat.st_mtime_ns]:
            hashes[name] = old
            continue
        hashes[name] = [stat.st_size, stat.st_mtime_ns, sha256_file(root / name)]
        read.append(name)
    if hashes != known:
        write_json(PRETRAINED_HASHES, {key: hashes})
    log.info("%s: %d of %d file(s) hashed, the rest unchanged", root, len(read), len(names))
    return hashes


def recorded(model: dict) -> dict | None:
    """The pretrained stage's record, when it describes this model.pretrained and revision."""
    try:
        record = json.loads(PRETRAINED.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    same = (record.get("pretrained"), record.get("revision"))
    return record if same == (model.get("pretrained"), model.get("revision")) else None


def folder(model: dict) -> Path | None:
    """model.pretrained's local folder (None when unset), never downloaded: a local folder as
    given, a Hub id's snapshot in the cache at the recorded commit, else at model.revision."""
    name = model.get("pretrained")
    if not name:
        return None
    pinned = model.get("source")  # a model `resolved` already: its folder, or where it came from
    if pinned:
        if Path(name).is_dir():
            return Path(name)
        return folder({"pretrained": pinned["pretrained"], "revision": pinned.get("commit")})
    if not is_hub_id(name):
        _check_no_revision(name, model.get("revision"))
        return Path(name).expanduser()
    record = recorded(model)
    revision = record.get("commit") if record else model.get("revision")
    return snapshot(name, revision, download=False)


def resolved(model: dict) -> dict:
    """The model section with model.pretrained as its local folder and "source" saying which
    checkpoint that is (the record without its files); unchanged when unset or resolved. A local
    folder must still be what the record says (else one line: rerun the pretrained stage)."""
    if not model.get("pretrained") or model.get("source"):
        return model
    record = recorded(model)
    if record is None or "sha256" in record:
        now = resolve(model)
        if record is not None and now["sha256"] != record["sha256"]:
            raise UsageError(
                f"model.pretrained: {model['pretrained']} changed since {PRETRAINED} recorded "
                "it; rerun the pretrained stage (dvc repro -f -s pretrained, or snakemake -R "
                "pretrained) so the stages after it see the change"
            )
        record = now
    pinned = {k: v for k, v in record.items() if k != "files"}
    return {**model, "pretrained": str(folder(model)), "source": pinned}


def identity(pinned: dict) -> str:
    """A checkpoint as one string: org/name@commit, or sha256:<content hash> for a folder."""
    if pinned.get("commit"):
        return f"{pinned['pretrained']}@{pinned['commit']}"
    return f"sha256:{pinned['sha256']}"


def describe(record: dict) -> str:
    """One line for the log: what model.pretrained resolved to."""
    if not record["pretrained"]:
        return "model.pretrained: null (training starts from model.preset)"
    size = sum(f["size"] for f in record["files"])
    what = f"commit {record['commit']}" if "commit" in record else f"sha256 {record['sha256']}"
    rev = f"@{record['revision']}" if record.get("revision") else ""
    count = len(record["files"])
    return (
        f"model.pretrained {record['pretrained']}{rev}: {what}, {count} files, {size / 1e6:.1f} MB"
    )
