"""The conversion cache: an HF directory converted to GGUF once, reused while it is unchanged.

An entry is ``<cache>/<model>-<key>-<dtype>.gguf`` with a manifest ``….json`` written after it.
The key is a SHA-256 over the names and contents of the files that define the model (config,
tokenizer, weights) and the converter's ``LAYOUT`` (what it writes for them), so an edited or
replaced model, or a converter that writes it differently, gets a new entry and the one made
from the same path before is removed (another model of the same name elsewhere keeps its own).
Hashing a 7B checkpoint takes seconds; the digest of each file is remembered in
``<cache>/digests.json`` by (path, size, mtime, inode) so a restart does not hash it again.

An entry is served only when its manifest names the same key and dtype, its size matches, and
the GGUF header checks out: a partial write (no manifest, or a file cut short) or a stale entry is
never served — it is removed and converted again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable

from dsr1d.engine.backend import model_name
from dsr1d.engine.errors import ModelError
from dsr1d.engine.gguf_convert import LAYOUT
from dsr1d.engine.gguf_file import inspect_gguf

Progress = Callable[[int, int, str], None]
Converter = Callable[[Path, Path, str, Progress | None], Path]
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja", "model.safetensors.index.json")
DIGESTS = "digests.json"
CHUNK = 8 << 20


def source_files(src: Path) -> list[Path]:
    """The files whose contents define the converted model, in a fixed order."""
    files = [src / name for name in MODEL_FILES if (src / name).is_file()]
    return files + sorted(src.glob("*.safetensors"))


def _file_digest(path: Path, memo: dict[str, str]) -> str:
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    if stamp not in memo:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        memo[stamp] = h.hexdigest()
    return memo[stamp]


def source_key(src: Path, cache: Path | None = None) -> str:
    """SHA-256 (hex, 16 digits) of the model's files; digests are memoised in ``cache``."""
    memo_path = cache / DIGESTS if cache else None
    memo: dict[str, str] = {}
    if memo_path and memo_path.is_file():
        try:
            memo = {k: v for k, v in json.loads(memo_path.read_text()).items()
                    if isinstance(v, str)}
        except (ValueError, AttributeError, OSError):
            memo = {}
    h = hashlib.sha256(f"dsr1d gguf layout {LAYOUT}\n".encode())
    for path in source_files(src):
        h.update(path.name.encode() + b"\0" + _file_digest(path, memo).encode() + b"\n")
    if memo_path:
        live = {k: v for k, v in memo.items() if Path(k.rsplit(":", 3)[0]).exists()}
        _write_atomic(memo_path, json.dumps(live, indent=1))
    return h.hexdigest()[:16]


def _name(src: Path) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model_name(src.resolve())) or "model"


def entry_path(src: Path, key: str, dtype: str, cache: Path) -> Path:
    """Where the conversion of ``src`` (content ``key``) to ``dtype`` lives in ``cache``."""
    return cache / f"{_name(src)}-{key}-{dtype}.gguf"


def _manifest_path(entry: Path) -> Path:
    return entry.with_suffix(".json")


def valid_entry(entry: Path, key: str, dtype: str) -> str | None:
    """None when ``entry`` may be served, else why not."""
    manifest = _manifest_path(entry)
    if not entry.is_file():
        return "no entry"
    if not manifest.is_file():
        return "no manifest (an interrupted conversion)"
    try:
        data = json.loads(manifest.read_text())
    except (ValueError, OSError) as exc:
        return f"unreadable manifest ({exc})"
    if not isinstance(data, dict) or data.get("key") != key or data.get("dtype") != dtype:
        return "the manifest names another source or dtype"
    if data.get("size") != entry.stat().st_size:
        return "its size differs from the manifest (cut short or overwritten)"
    try:
        inspect_gguf(entry)
    except ModelError as exc:
        return str(exc)
    return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_stale(src: Path, key: str, cache: Path, log: Callable[[str], None]) -> None:
    """Entries made from the same source path under another key (an older version of it), and
    temporary files of conversions whose process is gone; its other dtypes under the current key
    and other models' entries stay."""
    source = str(src.resolve())
    for manifest in cache.glob("*.json"):
        try:
            data = json.loads(manifest.read_text())
        except (ValueError, OSError):
            continue
        if isinstance(data, dict) and data.get("source") == source and data.get("key") != key:
            log(f"removing stale conversion {manifest.with_suffix('.gguf').name}")
            manifest.with_suffix(".gguf").unlink(missing_ok=True)
            manifest.unlink(missing_ok=True)
    for leftover in [*cache.glob(".*.tmp"), *cache.glob(".*.partial")]:
        pid = leftover.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            leftover.unlink(missing_ok=True)


def cached_gguf(src: Path, dtype: str, cache: Path, convert: Converter,
                progress: Progress | None = None,
                log: Callable[[str], None] = lambda _msg: None) -> Path:
    """The GGUF for ``src`` in ``dtype``: from the cache, or converted into it first."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create the conversion cache {cache}: {exc.strerror}") from None
    key = source_key(src, cache)
    entry = entry_path(src, key, dtype, cache)
    why = valid_entry(entry, key, dtype)
    if why is None:
        log(f"using the cached conversion {entry}")
        return entry
    if why != "no entry":
        log(f"not serving {entry.name}: {why}; converting again")
    _manifest_path(entry).unlink(missing_ok=True)
    entry.unlink(missing_ok=True)
    _remove_stale(src, key, cache, log)
    log(f"converting {src} to GGUF ({dtype}) into {entry}, once")
    convert(src, entry, dtype, progress)
    _write_atomic(_manifest_path(entry), json.dumps(
        {"source": str(src.resolve()), "key": key, "dtype": dtype,
         "size": entry.stat().st_size}, indent=1))
    return entry
