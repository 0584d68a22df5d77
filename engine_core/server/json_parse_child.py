"""The child process of ``json_parser.JsonParser``: parses request bodies, one at a time.

Run as a script (``python -I <this file>``): standard library only, so it starts in tens of
milliseconds and holds a few MB. It reads frames ``length u64 | body`` on stdin and answers
each with ``status u8 | length u64 | payload``: status 0 and the value in ``marshal``
format, or status 1 and why the body is not JSON (UTF-8 text). It exits at end of input
(its parent closed the pipe or died).
"""

from __future__ import annotations

import json
import marshal
import struct
import sys

FRAME = struct.Struct("!Q")
STATUS = struct.Struct("!BQ")
PARSED, INVALID = 0, 1


def reject_constant(name: str) -> None:
    """``json.loads``' parse_constant: NaN, Infinity and -Infinity are not JSON numbers."""
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes) -> tuple[int, bytes]:
    """(status, payload) of one body: strict JSON (no NaN or Infinity), as ``parse_json``."""
    try:
        value = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, RecursionError) as exc:
        return INVALID, f"request body is not valid JSON: {exc!r:.200}".encode()
    try:
        return PARSED, marshal.dumps(value)
    except ValueError as exc:  # nested past marshal's depth bound
        return INVALID, f"request body nests too deeply: {exc!r:.200}".encode()


def _read_exactly(stream: object, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = stream.read(remaining)  # type: ignore[attr-defined]
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (header := _read_exactly(stdin, FRAME.size)) is not None:
        body = _read_exactly(stdin, FRAME.unpack(header)[0])
        if body is None:
            return
        status, payload = parse(body)
        stdout.write(STATUS.pack(status, len(payload)))
        stdout.write(payload)
        stdout.flush()


if __name__ == "__main__":
    main()
