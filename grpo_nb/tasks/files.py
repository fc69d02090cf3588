"""Dataset files checked before the ``datasets`` loader reads them: a file it would refuse is an
:class:`~grpo_nb.config.InputError` that names the file, the line and what was expected, where
the loader's own error names neither (``JSON parse error … in row 2``)."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_nb.config import InputError, json_lines, json_where, utf8_text

JSON_EXPECTED = ('JSON Lines: one object per line, e.g. {"question": "…", "answer": "… #### 42"}'
                 ', or a JSON list of such objects')
PARQUET_MAGIC = b"PAR1"  # a Parquet file starts and ends with it
# the files the loader reads, and its builder for each
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def json_problem(path: Path) -> str | None:
    """Where ``path`` stops being JSON Lines (or, for ``.json``, a JSON list of objects), as
    ``"line N column C: …"``; None when every row is an object."""
    try:
        text = utf8_text(path)
        if path.suffix.lower() == ".json":
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as err:
                if err.msg != "Extra data":  # a value, then more: read it as JSON Lines
                    raise
            else:
                rows = doc if isinstance(doc, list) else [doc]
                bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
                if bad is None:
                    return None
                where = f"item {bad} of the top-level list" if isinstance(doc, list) else "top level"
                return f"{where}: {_kind(rows[bad])}, not a row object"
        return next((f"line {number}: {_kind(row)}, not a row object"
                     for number, row in json_lines(text) if not isinstance(row, dict)), None)
    except json.JSONDecodeError as err:
        return json_where(err)
    except ValueError as err:  # not UTF-8
        return str(err)


def check_data_file(path: Path) -> None:
    """Raise :class:`InputError` naming ``path``, the line and the expected format when the
    ``datasets`` loader would refuse it."""
    parquet = path.suffix.lower() == ".parquet"
    if path.stat().st_size == 0:
        raise InputError(f"dataset {path}: the file is empty; expected "
                         + ("a Parquet table" if parquet else JSON_EXPECTED))
    if not parquet:
        if problem := json_problem(path):
            raise InputError(f"dataset {path}, {problem}; expected {JSON_EXPECTED}")
        return
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(max(0, path.stat().st_size - 4))
        if (head, f.read(4)) != (PARQUET_MAGIC, PARQUET_MAGIC):
            raise InputError(f"dataset {path}: not a Parquet file (it does not start and end "
                             f"with {PARQUET_MAGIC!r}); expected a Parquet table of rows")


def check_data_folder(folder: Path) -> None:
    """:func:`check_data_file` for each data file in ``folder`` the loader would read."""
    for path in sorted(folder.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
        if path.is_file() and path.suffix.lower() in FILE_BUILDERS and not hidden:
            check_data_file(path)
