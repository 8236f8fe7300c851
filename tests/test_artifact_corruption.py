"""Malformed artifacts: each breaks one rule and must give a clear ArtifactError (API) and one `error:` line, exit 2 (CLI)."""

import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

import ninfer_offload
from ninfer_offload.artifact.codecs import encode_contiguous, encode_row_split
from ninfer_offload.artifact.formats import align_up
from ninfer_offload.artifact.writer import ArtifactWriter

CONTIG = "contiguous_le_v1"


def _valid(path, max_file_bytes=None):
    rng = np.random.default_rng(0)
    bank = rng.standard_normal((8, 130)).astype(np.float32)
    big = rng.standard_normal((40, 130)).astype(np.float32)
    w = ArtifactWriter(path, max_file_bytes=max_file_bytes)
    w.add_component("text", {"hidden_size": 130})
    w.add_component("mtp", {}, target="text")
    w.add_resource("resource/text/tokenizer.json", b"{}", role="tokenizer.json")
    w.add_tensor("weight/0", [8, 130], "q5_g64_fp16", "row_split_k128_v1", lambda: encode_row_split(bank, "q5_g64_fp16"))
    w.add_tensor("weight/1", [3], "fp32", CONTIG, lambda: encode_contiguous(np.ones(3), "fp32"))
    w.add_tensor("weight/2", [40, 130], "fp32", CONTIG, lambda: encode_contiguous(big, "fp32"))
    w.bind("bank", "weight/0")
    w.bind_parts("bank/row1", [("weight/0", 130, 260)])
    w.bind("ones", "weight/1")
    w.bind("big", "weight/2")
    w.use("bank", "input")
    return w.write()


def _split(path):
    raw = path.read_bytes()
    (json_bytes,) = struct.unpack("<Q", raw[8:16])
    start = align_up(32 + json_bytes, 4096)
    return raw[:32], json.loads(raw[32 : 32 + json_bytes]), raw[start:]


def _write_entry(path, text: bytes, header: bytes, payload: bytes, json_bytes=None, magic=None):
    """Entry with the JSON unpadded (so a non-empty zero gap precedes the payload)."""
    json_bytes = len(text) if json_bytes is None else json_bytes
    gap = align_up(32 + len(text), 4096) - 32 - len(text)
    head = (magic or header[:8]) + struct.pack("<Q", json_bytes) + header[16:32]
    path.write_bytes(head + text + bytes(gap) + payload)


def _mutate(change):
    """A case that edits the decoded JSON root and rewrites the entry around the same payload."""

    def build(path):
        header, root, payload = _split(path)
        change(root)
        _write_entry(path, json.dumps(root).encode(), header, payload)

    return build


def _text(edit):
    def build(path):
        header, root, payload = _split(path)
        _write_entry(path, edit(json.dumps(root, separators=(",", ":")).encode()), header, payload)

    return build


def _raw(edit):
    def build(path):
        path.write_bytes(edit(path.read_bytes()))

    return build


def _obj(i, **members):
    def change(root):
        root["objects"][i].update(members)

    return _mutate(change)


def _set(key_path, value):
    def change(root):
        node = root
        for key in key_path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[key_path[-1]]
        else:
            node[key_path[-1]] = value

    return _mutate(change)


_DELETE = object()

# (case id, builder, regex the message must match). Opening the file must fail.
OPEN_CASES = [
    ("truncated-entry", _raw(lambda b: b[:-100]), r"entry file has \d+ bytes.*truncated"),
    ("truncated-header", _raw(lambda b: b[:20]), r"truncated header"),
    ("empty-file", _raw(lambda b: b""), r"truncated header"),
    ("wrong-magic", _raw(lambda b: b"GGUF\x03\x00\x00\x00" + b[8:]), r"wrong magic 4747554603000000"),
    ("v2-magic", _raw(lambda b: b"NINFER\x00\x02" + b[8:]), r"version 2 is not supported.*upgrade"),
    ("part-as-entry", _raw(lambda b: b"NINPRT\x00\x03" + b[8:]), r"continuation part, not an entry"),
    ("json-past-eof", _raw(lambda b: b[:8] + struct.pack("<Q", 10**9) + b[16:]), r"json_bytes 1000000000 runs past the end"),
    ("json-bytes-zero", _raw(lambda b: b[:8] + struct.pack("<Q", 0) + b[16:]), r"json_bytes is 0"),
    ("invalid-utf8", _text(lambda t: t.replace(b'"hidden_size"', b'"hidden\xff"')), r"not valid UTF-8"),
    ("invalid-json", _text(lambda t: t[:-1]), r"not valid JSON"),
    ("duplicate-key", _text(lambda t: b'{"uses":[],' + t[1:]), r"duplicate member 'uses'"),
    ("nan-literal", _text(lambda t: t.replace(b'"hidden_size":130', b'"hidden_size":NaN')), r"literal NaN"),
    ("missing-root-member", _set(["uses"], _DELETE), r"directory root: missing member 'uses'"),
    ("extra-root-member", _set(["version"], 3), r"directory root: unknown member 'version'"),
    ("extra-object-member", _obj(1, note="x"), r"object 'weight/0': unknown member 'note'"),
    ("missing-object-member", _set(["objects", 1, "layout"], _DELETE), r"object 'weight/0': missing member 'layout'"),
    ("unknown-kind", _obj(1, kind="blob"), r"object 'weight/0': kind must be"),
    ("bool-as-integer", _obj(2, offset=True), r"object 'weight/1' offset: must be an integer, got a boolean"),
    ("float-as-integer", _obj(2, bytes=12.0), r"object 'weight/1' bytes: must be an integer, got a float"),
    ("negative-offset", _obj(2, offset=-256), r"object 'weight/1' offset: -256 is outside the unsigned 64-bit range"),
    ("overflowing-bytes", _obj(2, bytes=2**64), r"object 'weight/1' bytes: \d+ is outside the unsigned 64-bit range"),
    ("overflowing-shape", _obj(3, shape=[2**32, 2**32, 2**32]), r"object 'weight/2' shape: element count overflows"),
    ("zero-dimension", _obj(3, shape=[0, 130]), r"object 'weight/2' shape\[0\]: must be positive"),
    ("rank-17", _obj(2, shape=[1] * 17), r"object 'weight/1' shape: rank 17 exceeds 16"),
    ("zero-bytes", _obj(0, bytes=0), r"object 'resource/text/tokenizer.json' bytes: must be positive"),
    ("misaligned-offset", _obj(2, offset=2000), r"object 'weight/1': offset 2000 is not a multiple of the tensor alignment 256"),
    ("overlapping-objects", _obj(2, offset=256), r"object 'weight/1': offset 256 overlaps .*'weight/0'"),
    ("duplicate-id", _obj(2, id="weight/0"), r"object 'weight/0': duplicate object id"),
    ("object-past-payload", _obj(3, offset=1 << 20), r"object 'weight/2': ends at \d+, past the payload"),
    ("bytes-not-encoded-size", _obj(1, shape=[7, 130]), r"object 'weight/0': bytes \d+ != encoded size \d+ of q5_g64_fp16"),
    ("range-out-of-bounds", _set(["bindings", "bank/row1", "parts", 0, "range"], [130, 1041]),
     r"binding 'bank/row1' part 0: range \[130, 1041\) is outside object 'weight/0' of 1040 elements"),
    ("empty-range", _set(["bindings", "bank/row1", "parts", 0, "range"], [5, 5]), r"range \[5, 5\) is outside"),
    ("binding-to-resource", _set(["bindings", "ones"], {"object": "resource/text/tokenizer.json"}),
     r"binding 'ones': references resource object 'resource/text/tokenizer.json'"),
    ("binding-unknown-object", _set(["bindings", "ones"], {"object": "weight/7"}), r"binding 'ones': references unknown object 'weight/7'"),
    ("binding-both-forms", _set(["bindings", "ones"], {"object": "weight/1", "parts": []}), r"binding 'ones': has both"),
    ("binding-empty-parts", _set(["bindings", "ones"], {"parts": []}), r"binding 'ones': parts must be a non-empty array"),
    ("use-unknown-parameter", _set(["uses", 0, "parameter"], "nothing"), r"uses\[0\]: parameter 'nothing' is not a binding"),
    ("use-bad-policy", _set(["uses", 0, "activation_policy"], "AllowA2"), r"activation_policy 'AllowA2' is not one of"),
    ("use-duplicate", _mutate(lambda r: r["uses"].append(dict(r["uses"][0]))), r"duplicate \(parameter, input\) pair"),
    ("no-text-component", _mutate(lambda r: r["components"].update(text=None) or r["components"].pop("text")),
     r"the 'text' component is required"),
    ("unknown-target", _set(["components", "mtp", "target"], "dflash"), r"component 'mtp': target 'dflash' is not a component"),
    ("resource-role-to-tensor", _set(["components", "text", "resources", "tokenizer.json"], "weight/1"),
     r"resource 'tokenizer.json' must reference a resource object"),
    ("proposal-off-text", _set(["components", "mtp", "proposal"], {"domain": "full"}), r"only the text component may carry a proposal"),
    ("proposal-bad-domain", _set(["components", "text", "proposal"], {"domain": "some"}), r"domain must be"),
    ("files-empty", _set(["files"], []), r"files: must be a non-empty array"),
    ("entry-path-not-null", _set(["files", 0, "path"], "x"), r"files\[0\]: path of the entry file must be null"),
    ("config-not-object", _set(["components", "text", "config"], [1]), r"component 'text' config: must be a JSON object, got an array"),
]


@pytest.mark.parametrize("case,build,message", OPEN_CASES, ids=[c[0] for c in OPEN_CASES])
def test_open_rejects(tmp_path, case, build, message):
    path = _valid(tmp_path / "a.ninfer")
    build(path)
    with pytest.raises(ninfer_offload.ArtifactError, match=message):
        ninfer_offload.open_artifact(path)


def _parts(tmp_path):
    path = _valid(tmp_path / "a.ninfer", max_file_bytes=3 * 4096)
    parts = sorted(p for p in os.listdir(tmp_path) if ".part-" in p)
    assert len(parts) >= 2
    return path, tmp_path / parts[0]


def _patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


PART_CASES = [
    ("missing-part", lambda part: part.unlink(), r"part file files\[1\]: file '.*part-0001' is missing"),
    ("part-wrong-id", lambda part: _patch(part, 16, b"\x00" * 16), r"part file files\[1\]: artifact_id 0{32} does not match"),
    ("part-wrong-index", lambda part: _patch(part, 8, struct.pack("<Q", 2)), r"part file files\[1\]: header says part index 2"),
    ("part-wrong-magic", lambda part: _patch(part, 0, b"NINFER\x00\x03"), r"part file files\[1\]: wrong magic"),
    (
        "part-wrong-size",
        lambda part: part.write_bytes(part.read_bytes()[:-1]),
        r"part file files\[1\]: file has \d+ bytes, the files table requires",
    ),
]


@pytest.mark.parametrize("case,damage,message", PART_CASES, ids=[c[0] for c in PART_CASES])
def test_parts_are_checked_lazily(tmp_path, case, damage, message):
    path, part = _parts(tmp_path)
    damage(part)
    with ninfer_offload.open_artifact(path) as art:  # the directory alone is fine
        assert art.tensor("ones").tolist() == [1.0, 1.0, 1.0]  # in the entry: the part is never opened
        with pytest.raises(ninfer_offload.ArtifactError, match=message):
            art.tensor("big")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"format": "fp64"}, r"object 'weight/1': format 'fp64' is not supported by layout 'contiguous_le_v1'"),
        ({"layout": "tiles_v9"}, r"object 'weight/1': unknown layout 'tiles_v9'"),
    ],
)
def test_unknown_format_or_layout_fails_when_decoded(tmp_path, change, message):
    path = _valid(tmp_path / "a.ninfer")
    _obj(2, **change)(path)
    with ninfer_offload.open_artifact(path) as art:
        assert art.object("weight/1").format == change.get("format", "fp32")
        with pytest.raises(ninfer_offload.ArtifactError, match=message):
            art.tensor("ones")


def test_nonempty_zero_gap_is_accepted(tmp_path):
    path = _valid(tmp_path / "a.ninfer")
    _mutate(lambda root: None)(path)  # rewritten without space padding
    with ninfer_offload.open_artifact(path) as art:
        assert art.tensor("ones").tolist() == [1.0, 1.0, 1.0]


# ----------------------------------------------------------------------------- CLI: one line, exit 2


def _cli_runs(jobs):
    """Run `ninfer inspect` for every (args) concurrently; returns [(returncode, stdout, stderr)]."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ninfer_offload", "inspect", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for args in jobs
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        results.append((p.returncode, out, err))
    return results


# One CLI run per kind of damage in the list (the API tests above cover every rule).
CLI_OPEN_CASES = (
    "truncated-entry", "v2-magic", "json-past-eof", "invalid-utf8", "duplicate-key", "extra-object-member",
    "bool-as-integer", "overflowing-bytes", "misaligned-offset", "overlapping-objects", "object-past-payload",
    "bytes-not-encoded-size", "range-out-of-bounds", "binding-to-resource",
)
CLI_PART_CASES = ("missing-part", "part-wrong-id")


def test_cli_reports_corruption_in_one_line(tmp_path):
    jobs, messages = [], []
    for case, build, message in OPEN_CASES:
        if case in CLI_OPEN_CASES:
            path = _valid(tmp_path / f"{case}.ninfer")
            build(path)
            jobs.append([str(path)])
            messages.append(message)
    for case, damage, message in PART_CASES:
        if case in CLI_PART_CASES:
            (tmp_path / case).mkdir()
            path, part = _parts(tmp_path / case)
            damage(part)
            jobs.append([str(path), "--verify"])
            messages.append(message)
    path = _valid(tmp_path / "unknown-format.ninfer")
    _obj(2, format="fp64")(path)
    jobs.append([str(path), "--verify", "--json"])
    messages.append(r"verify found invalid payload in 1 objects \(first: 'weight/1'.*format 'fp64'")
    jobs.append([str(tmp_path / "nothing.ninfer")])
    messages.append(r"no such artifact")
    for (code, out, err), message, args in zip(_cli_runs(jobs), messages, jobs):
        assert code == 2, (args, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert re.search(message, err), (message, err)
