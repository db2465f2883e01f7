"""benchmarks/schema_coverage.py end to end on a folder of three small schemas (the
tiny model's tokenizer): one both libraries compile, one minillm refuses by keyword,
one jsonschema itself rejects."""

import json
import sys

import pytest

pytest.importorskip("xgrammar")


def test_schema_coverage_runs_end_to_end(tmp_path, monkeypatch):
    from benchmarks import schema_coverage

    data = tmp_path / "Mini"
    data.mkdir()
    schemas = {
        "a_object.json": {"type": "object", "properties": {"n": {"type": "integer"}},
                          "required": ["n"], "additionalProperties": False},
        "b_not.json": {"not": {"pattern": "a"}},
        "c_bad.json": {"type": "object", "minProperties": "two"},
    }  # fmt: skip
    for name, schema in schemas.items():
        (data / name).write_text(json.dumps(schema))
    argv = ["schema_coverage.py", str(data), "--model", "tiny", "--walks", "2"]
    argv += ["--max-tokens", "24", "--time-limit", "20", "--out", str(tmp_path)]
    argv += ["--source", "Mini=me/mine@0123"]
    monkeypatch.setattr(sys, "argv", argv)
    # a test run, not a result: stored even from a working tree with changes
    monkeypatch.setenv("MINILLM_FORCE_STORE", "1")
    path = schema_coverage.main()

    record = json.loads(path.read_text())
    sub = record["subsets"]["Mini"]
    assert sub["source"] == "me/mine@0123"
    rows = {row["file"]: row for row in sub["rows"]}
    assert list(rows) == sorted(schemas)
    ours = rows["a_object.json"]["minillm"]
    assert ours["status"] == "compiled" and ours["verdicts"] == ["valid", "valid"]
    assert rows["a_object.json"]["xgrammar"]["status"] == "compiled"
    assert rows["b_not.json"]["minillm"]["status"] == "unsupported"
    assert rows["b_not.json"]["minillm"]["detail"] == "not"
    assert not rows["c_bad.json"]["jsonschema_ok"]
    summary = sub["summary"]
    assert summary["schemas"] == 3 and summary["jsonschema_rejects"] == 1
    assert summary["minillm"]["refusals"].get("not") == 1
    assert summary["minillm"]["valid"] >= 2
