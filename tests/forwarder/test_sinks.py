"""The jsonl sink, and what a reader of its file reads while the forwarder appends."""

from __future__ import annotations

import io
import json
from pathlib import Path

from forwarder.durable_state import SpooledEnvelope
from forwarder.sinks import JsonLinesSink
from tests.forwarder.conftest import read_envelopes


def envelope(n: int, size: int) -> SpooledEnvelope:
    return SpooledEnvelope(id=n, sequence=n, kind="hook", body=json.dumps({"n": n, "pad": "x" * size}).encode())


def test_a_file_is_appended_whole_batches_of_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text('{"n": -1}\n')  # appended to, never truncated
    sink = JsonLinesSink(path=path)
    sink.send([envelope(0, 10), envelope(1, 20_000)], partition_key="web_0")
    sink.send([envelope(2, 5)], partition_key="web_0")
    sink.close()
    sink.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["n"] for line in lines] == [-1, 0, 1, 2]
    assert len(json.loads(lines[2])["pad"]) == 20_000


def test_a_reader_of_a_file_being_appended_reads_whole_lines_only(tmp_path: Path) -> None:
    # The kernel publishes a write page by page: a test reading the forwarder's file met half an attested envelope.
    path = tmp_path / "out.jsonl"
    path.write_text('{"n": 0}\n{"n": 1}\n{"n": 2, "pad": "xx')  # a write seen in part
    assert [e["n"] for e in read_envelopes(path)] == [0, 1]
    assert read_envelopes(tmp_path / "absent.jsonl") == []


def test_a_stream_gets_one_line_per_envelope() -> None:
    stream = io.StringIO()
    JsonLinesSink(stream=stream).send([envelope(0, 1), envelope(1, 1)], partition_key="web_0")
    assert [json.loads(line)["n"] for line in stream.getvalue().splitlines()] == [0, 1]
