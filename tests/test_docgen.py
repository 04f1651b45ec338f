"""The reference tables in docs/ are generated from the code; these tests fail when they drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from stageferry import docgen, errors
from stageferry.broker.control.keys import KEY_DOCS, Keys
from stageferry.config import Limits
from stageferry.schemas import JobRequest

ROOT = Path(__file__).resolve().parent.parent


def test_committed_docs_match_the_code() -> None:
    stale = docgen.stale_files(ROOT / "docs", write=False)
    assert stale == [], f"run scripts/gen_docs.py: {', '.join(p.name for p in stale)} drifted from the code"


def test_every_block_has_a_generator_and_every_generator_is_used() -> None:
    used = [name for path in (ROOT / "docs").glob("*.md") for name in docgen.blocks(path.read_text())]
    assert sorted(set(used)) == sorted(docgen.GENERATORS)


def test_check_mode_of_the_script_fails_on_a_stale_block(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "errors.md"
    page.parent.mkdir()
    page.write_text("# Errors\n\n<!-- generated:errors -->\n| old | table |\n<!-- /generated:errors -->\n")
    assert docgen.stale_files(page.parent, write=False) == [page]
    assert docgen.stale_files(page.parent, write=True) == [page]
    assert "`payload_unavailable` | `PayloadUnavailableError` | `DataPlaneError`" in page.read_text()
    assert docgen.stale_files(page.parent, write=False) == []
    script = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], capture_output=True, text=True
    )
    assert script.returncode == 0, script.stderr


def test_key_table_names_every_key_method_with_its_real_pattern() -> None:
    rows = dict(docgen.key_rows())
    assert rows["<p>:req-cancel:<id>"].startswith("string:")
    public = [n for n, v in vars(Keys).items() if not n.startswith("_") and callable(v)]
    assert len(rows) == len([n for n in public if KEY_DOCS[n] is not None])


def test_error_table_has_every_class_and_its_code() -> None:
    codes = {row[0]: row[1] for row in docgen.error_rows()}
    classes = [cls for _, cls in docgen._error_classes()][1:]
    assert {cls.code for cls in classes} == set(codes)
    assert codes["peer_disconnected"] == "PeerDisconnectedError"


def test_an_error_class_missing_from_the_docstring_tree_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = errors.__doc__ or ""
    monkeypatch.setattr(errors, "__doc__", "\n".join(ln for ln in doc.splitlines() if "ClaimError" not in ln))
    with pytest.raises(KeyError, match="ClaimError"):
        docgen.error_rows()


def test_a_field_without_a_docstring_is_refused() -> None:
    class Undocumented(BaseModel):
        retries: int = Field(3, ge=0, le=9)

    with pytest.raises(KeyError, match=r"Undocumented\.retries"):
        docgen.field_rows(Undocumented)


def test_ranges_come_from_the_validators() -> None:
    schema = JobRequest.model_json_schema()
    assert docgen.allowed(schema, "width") == "64–2048"
    assert docgen.allowed(schema, "duration") == "> 0, ≤ 30"
    assert docgen.allowed(schema, "task") == "t2va | fl2va | ref2va | i2va"
    assert docgen.allowed(Limits.model_json_schema(), "max_upload_bytes") == "1 KiB–1 GiB"
