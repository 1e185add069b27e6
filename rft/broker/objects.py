"""A minimal S3-compatible object server on a local directory: the storage behind the durable local broker.

Tansu's S3 storage engine (rft/broker/local.py) keeps every record batch and piece of metadata as one object and
relies on conditional writes (`If-None-Match: *`, `If-Match: <etag>`); no local S3 server on PyPI both persists
and honours `If-Match`, so rft serves the handful of calls Tansu makes, with the standard library only.
Served, path-style (`http://HOST:PORT/BUCKET/KEY`), credentials not checked: PUT object (conditional: 412), GET /
HEAD object (Range; conditional), DELETE object, POST ?delete, GET bucket ?list-type=2 (prefix, delimiter `/`,
start-after, continuation-token, max-keys; without max-keys one page of up to 100,000 keys), PUT / HEAD bucket.

Contract (what the durable broker's guarantees rest on):
- An object is the file `ROOT/BUCKET/KEY`. A PUT writes and fsyncs a temporary file, then, under one lock that also
  checks the condition, links or renames it into place and fsyncs the directory; only then is the 200 sent. An
  acknowledged PUT survives a SIGKILL (and, as far as fsync holds, a power loss); an interrupted one leaves the old
  object or the new one, never a torn one.
- ETags are the quoted MD5 of the content; a GET or HEAD answers from one snapshot. Keys stay inside ROOT: an
  empty, `.` or `..` part, a NUL or a backslash is a 400; no Content-Length is a 411; a malformed one is a 400.
- One server per ROOT (the broker locks its data directory).
`python -m rft.broker.objects ROOT [--port 0] [--ready-file PATH] [--access-log PATH]`: serves until SIGTERM;
--ready-file receives the port once it accepts; --access-log appends `METHOD /BUCKET/KEY?QUERY STATUS` per request.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import stat
import sys
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO
from urllib.parse import parse_qs, unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

TMP_PREFIX = ".rft-tmp-"
XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
MAX_KEYS = 100_000  # a page's entries when the request names no max-keys, and the most it may ask for (S3: 1,000)


class S3Error(Exception):
    def __init__(self, status: int, code: str, message: str = ""):
        super().__init__(message or code)
        self.status, self.code, self.message = status, code, message or code


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    """What identifies one version of a file for the ETag cache: (inode, mtime in ns, size)."""
    return st.st_ino, st.st_mtime_ns, st.st_size


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Snapshot:
    """One version of an object (ObjectStore.open): `file` open at its start, `stat` and `etag` of that version."""
    file: BinaryIO
    stat: os.stat_result
    etag: str

    @property
    def size(self) -> int:
        return self.stat.st_size

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


class ObjectStore:
    """Objects as files under `root` (one directory per bucket). Thread-safe: conditional writes are checked and
    committed under one lock."""

    def __init__(self, root: str | os.PathLike, fsync: bool = True):
        self.root = Path(root).resolve()
        self.fsync = fsync
        self._lock = threading.Lock()
        self._etags: dict[str, tuple[tuple[int, int, int], str]] = {}  # by the file's path
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if name.startswith(TMP_PREFIX):
                    os.unlink(os.path.join(dirpath, name))

    def path(self, bucket: str, key: str = "") -> Path:
        """The file of `bucket`/`key` (the bucket's directory without a key), always inside the root: S3Error 400
        for an empty, `.` or `..` part, a temporary file's name, or a NUL or backslash."""
        return self.root.joinpath(*_parts(bucket, key.split("/") if key else [], what="bucket or key"))

    def etag(self, path: Path) -> str:
        """The ETag of the file at `path` now (callers hold the lock when it must match a later read)."""
        with open(path, "rb") as f:
            return self._etag(path, os.fstat(f.fileno()), f)

    def listed_etag(self, path: str, st: os.stat_result) -> str:
        """The ETag of the object in the file `path` as a listing saw it (`st`): from the cache when that version
        was hashed before (every PUT and GET hashes or caches), else hashed now."""
        with self._lock:
            cached = self._etags.get(path)
            if cached and cached[0] == _signature(st):
                return cached[1]
            return self.etag(Path(path))

    def _etag(self, path: Path, st: os.stat_result, f: BinaryIO) -> str:
        """The ETag of the open file `f` (stat `st`) at `path`: cached by (inode, mtime, size), else hashed (and
        `f` left at its start)."""
        signature = _signature(st)
        cached = self._etags.get(str(path))
        if cached and cached[0] == signature:
            return cached[1]
        digest = hashlib.md5()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        f.seek(0)
        etag = f'"{digest.hexdigest()}"'
        self._etags[str(path)] = (signature, etag)
        return etag

    def _makedirs(self, directory: Path) -> None:
        """mkdir -p, fsyncing the parent of every directory it creates (a new file's name must survive too)."""
        missing = []
        while not directory.exists():
            missing.append(directory)
            directory = directory.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                pass
            if not d.is_dir():
                raise S3Error(409, "InvalidRequest", f"{d.relative_to(self.root)} is an object, not a prefix")
            if self.fsync:
                _fsync_dir(d.parent)

    def put(self, bucket: str, key: str, body: bytes, if_match: str | None, if_none_match: str | None) -> str:
        target = self.path(bucket, key)
        if target.is_dir():
            raise S3Error(409, "InvalidRequest", f"{bucket}/{key} is a prefix of other objects")
        self._makedirs(target.parent)
        etag = f'"{hashlib.md5(body).hexdigest()}"'
        tmp = target.parent / f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{target.name}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            with self._lock:
                exists = target.is_file()
                if if_none_match is not None and if_none_match.strip() == "*" and exists:
                    raise S3Error(412, "PreconditionFailed", "the object exists (If-None-Match: *)")
                if if_match is not None and (not exists or not _etag_in(if_match, self.etag(target))):
                    raise S3Error(412 if exists else 404, "PreconditionFailed" if exists else "NoSuchKey",
                                  "If-Match does not match the current ETag")
                if if_none_match is not None and if_none_match.strip() == "*":
                    os.link(tmp, target)  # fails if it appeared meanwhile: only this lock's holder writes, though
                    os.unlink(tmp)
                else:
                    os.replace(tmp, target)
                self._etags[str(target)] = (_signature(target.stat()), etag)
                if self.fsync:
                    _fsync_dir(target.parent)
        finally:
            if tmp.exists():
                tmp.unlink()
        return etag

    def open(self, bucket: str, key: str) -> Snapshot:
        """One version of the object: an open file, its stat and its ETag, taken under the lock that PUTs replace
        objects under, so the three belong to the same version whatever is written after (a replaced object's
        file stays readable through this handle). The caller closes it (a context manager)."""
        path = self.path(bucket, key)
        with self._lock:
            try:
                f = open(path, "rb")
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise S3Error(404, "NoSuchKey", f"{bucket}/{key} does not exist") from None
            try:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise S3Error(404, "NoSuchKey", f"{bucket}/{key} does not exist")
                return Snapshot(f, st, self._etag(path, st, f))
            except BaseException:
                f.close()
                raise

    def delete(self, bucket: str, key: str) -> None:
        path = self.path(bucket, key)
        bucket_dir = self.path(bucket)
        with self._lock:
            try:
                path.unlink()
            except (FileNotFoundError, IsADirectoryError):
                return
            self._etags.pop(str(path), None)
            parent = path.parent
            while parent != bucket_dir and parent != self.root:  # drop emptied prefixes, as S3 shows none
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent
            if self.fsync and parent.exists():
                _fsync_dir(parent)

    def list(self, bucket: str, prefix: str, delimiter: str, after: str, limit: int | None = None
             ) -> list[tuple[str, os.stat_result | None, str | None]]:
        """The objects and common prefixes under `prefix` with keys > `after`, sorted by key, the first `limit` of
        them: (key, stat, file path) for an object, (prefix, None, None) for a common prefix. Only the objects
        returned are stat-ed: a page of a large listing costs a scan of names and a stat per entry on the page, not
        one per object below it."""
        bucket_dir = self.path(bucket)
        if delimiter not in ("", "/"):
            raise S3Error(400, "InvalidArgument", "only the delimiter '/' is supported")
        # every directory part of the prefix must be a plain name; the last (partial) part only filters names
        base = self.root.joinpath(*_parts(bucket, prefix.split("/")[:-1], what="prefix"))
        base_key = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
        files: dict[str, str] = {}  # key -> path
        prefixes: set[str] = set()  # common prefixes
        if not base.is_dir():
            return []
        if delimiter:
            for entry in os.scandir(base):
                key = base_key + entry.name
                if entry.name.startswith(TMP_PREFIX) or not key.startswith(prefix) or key <= after:
                    continue
                if entry.is_dir():
                    prefixes.add(key + "/")
                elif entry.is_file():
                    files[key] = entry.path
        else:
            for dirpath, _dirnames, names in os.walk(base):
                rel = os.path.relpath(dirpath, bucket_dir)
                key_dir = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                for name in names:
                    key = key_dir + name
                    if not name.startswith(TMP_PREFIX) and key.startswith(prefix) and key > after:
                        files[key] = os.path.join(dirpath, name)
        entries: list[tuple[str, os.stat_result | None, str | None]] = []
        for key in sorted([*files, *prefixes])[:limit]:
            if key not in files:
                entries.append((key, None, None))
                continue
            try:
                entries.append((key, os.stat(files[key]), files[key]))
            except FileNotFoundError:  # deleted since the scan
                pass
        return entries


def _parts(bucket: str, parts: list[str], *, what: str) -> list[str]:
    """[bucket, *parts] when each is a plain name (module docstring: objects and prefixes stay inside the root)."""
    names = [bucket, *parts]
    if not bucket or any(p in ("", ".", "..") or p.startswith(TMP_PREFIX) or "\0" in p or "\\" in p for p in names):
        raise S3Error(400, "InvalidArgument", f"unsupported {what}: {'/'.join(names)!r} (empty, '.' or '..' parts, "
                      "NUL and backslash are refused)")
    return names


def _etag_in(header: str, etag: str) -> bool:
    candidates = [c.strip() for c in header.split(",")]
    return "*" in candidates or etag in candidates or etag.strip('"') in (c.strip('"') for c in candidates)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: ObjectStore  # set on the subclass that `serve` makes
    access_log: AccessLog | None = None  # ... and, with --access-log, this

    def log_message(self, fmt, *args):  # quiet: Tansu makes thousands of requests
        pass

    def log_request(self, code="-", size="-"):
        if self.access_log is not None:
            self.access_log.write(f"{self.command} {self.path} {int(code) if str(code).isdigit() else code}")

    def _split(self) -> tuple[str, str, dict[str, list[str]]]:
        url = urlsplit(self.path)
        bucket, _, key = unquote(url.path).lstrip("/").partition("/")
        return bucket, key, parse_qs(url.query, keep_blank_values=True)

    def _body(self) -> bytes:
        """The body of a PUT or POST: exactly Content-Length bytes. 411 without one (a chunked upload is not
        read, so it cannot be stored as an empty object), 400 for a length that is not a number >= 0, and 400
        when the connection ends before that many bytes came."""
        header = self.headers.get("Content-Length")
        if header is None:
            self.close_connection = True  # the unread body must not be taken for the next request
            raise S3Error(411, "MissingContentLength", "a PUT or POST needs a Content-Length (chunked uploads are "
                          "not supported)")
        if not header.strip().isdigit():
            self.close_connection = True
            raise S3Error(400, "InvalidArgument", f"Content-Length {header!r} is not a number of bytes")
        length = int(header)
        body = self.rfile.read(length) if length else b""
        if len(body) != length:
            self.close_connection = True
            raise S3Error(400, "IncompleteBody", f"{len(body)} of the {length} bytes announced came")
        return body

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              head: bool = False) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)) if not head else (headers or {}).get("Content-Length",
                                                                                              str(len(body))))
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _error(self, e: S3Error, head: bool = False) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{e.code}</Code>'
                f"<Message>{escape(e.message)}</Message></Error>").encode()
        self._send(e.status, b"" if head else body, {"Content-Type": "application/xml"})

    def _dispatch(self, method: str) -> None:
        try:
            bucket, key, query = self._split()
            body = self._body() if method in ("PUT", "POST") else b""
            getattr(self, f"_{method.lower()}")(bucket, key, query, body)
        except S3Error as e:
            self._error(e, head=method == "HEAD")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - one bad request must not end the server
            self._error(S3Error(500, "InternalError", f"{type(e).__name__}: {e}"), head=method == "HEAD")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_POST(self):
        self._dispatch("POST")

    def _put(self, bucket, key, query, body):
        if not key:
            self.store._makedirs(self.store.path(bucket))
            return self._send(200)
        if "x-amz-copy-source" in self.headers or "partNumber" in query or "uploads" in query:
            raise S3Error(501, "NotImplemented", "copy and multipart uploads are not supported")
        etag = self.store.put(bucket, key, body, self.headers.get("If-Match"), self.headers.get("If-None-Match"))
        self._send(200, headers={"ETag": etag})

    def _head(self, bucket, key, query, body):
        self._get(bucket, key, query, body, head=True)

    def _get(self, bucket, key, query, body, head=False):
        if not key:
            if head:
                if not self.store.path(bucket).is_dir():
                    raise S3Error(404, "NoSuchBucket")
                return self._send(200, head=True)
            return self._list(bucket, query)
        with self.store.open(bucket, key) as snapshot:
            self._send_object(snapshot, head)

    def _send_object(self, snapshot: Snapshot, head: bool) -> None:
        st, etag = snapshot.stat, snapshot.etag
        if_match, if_none = self.headers.get("If-Match"), self.headers.get("If-None-Match")
        if if_match is not None and not _etag_in(if_match, etag):
            raise S3Error(412, "PreconditionFailed")
        headers = {"ETag": etag, "Last-Modified": formatdate(st.st_mtime, usegmt=True),
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if if_none is not None and _etag_in(if_none, etag):
            return self._send(304, headers=headers)
        start, end, status = 0, st.st_size, 200
        wanted = self.headers.get("Range")
        if wanted:
            start, end = _range(wanted, st.st_size)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{st.st_size}"
        if head:
            headers["Content-Length"] = str(end - start)
            return self._send(status, headers=headers, head=True)
        snapshot.file.seek(start)
        self._send(status, snapshot.file.read(end - start), headers)

    def _list(self, bucket, query):
        if query.get("list-type", [""])[0] != "2":
            raise S3Error(501, "NotImplemented", "only ListObjectsV2 (list-type=2) is supported")
        q = {k: v[0] for k, v in query.items()}
        prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
        after = max(q.get("start-after", ""), q.get("continuation-token", ""))
        max_keys = q.get("max-keys") or str(MAX_KEYS)
        if not max_keys.isdigit():
            raise S3Error(400, "InvalidArgument", f"max-keys {max_keys!r} is not a number >= 0")
        max_keys = min(int(max_keys), MAX_KEYS)
        # max-keys=0 is an empty page with nothing to continue from (as S3 answers it), not a scan
        entries = self.store.list(bucket, prefix, delimiter, after, limit=max_keys + 1) if max_keys else []
        truncated = len(entries) > max_keys
        entries = entries[:max_keys]
        parts = [f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="{XMLNS}">',
                 f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
                 f"<KeyCount>{len(entries)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>",
                 f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if delimiter:
            parts.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        for k, st, file in entries:
            if st is None:
                parts.append(f"<CommonPrefixes><Prefix>{escape(k)}</Prefix></CommonPrefixes>")
            else:
                try:
                    etag = self.store.listed_etag(file, st)
                except FileNotFoundError:
                    continue
                parts.append(f"<Contents><Key>{escape(k)}</Key><LastModified>{_iso(st.st_mtime)}</LastModified>"
                             f"<ETag>{escape(etag)}</ETag><Size>{st.st_size}</Size>"
                             "<StorageClass>STANDARD</StorageClass></Contents>")
        if truncated:
            parts.append(f"<NextContinuationToken>{escape(entries[-1][0])}</NextContinuationToken>")
        parts.append("</ListBucketResult>")
        self._send(200, "".join(parts).encode(), {"Content-Type": "application/xml"})

    def _delete(self, bucket, key, query, body):
        if key:
            self.store.delete(bucket, key)
        self._send(204)

    def _post(self, bucket, key, query, body):
        if key or "delete" not in query:
            raise S3Error(501, "NotImplemented", "only DeleteObjects (POST ?delete) is supported")
        root = ElementTree.fromstring(body)
        keys = [e.text or "" for e in root.iter() if e.tag.rsplit("}", 1)[-1] == "Key"]
        quiet = any(e.tag.rsplit("}", 1)[-1] == "Quiet" and (e.text or "").strip() == "true" for e in root.iter())
        for k in keys:
            self.store.delete(bucket, k)
        deleted = "" if quiet else "".join(f"<Deleted><Key>{escape(k)}</Key></Deleted>" for k in keys)
        self._send(200, f'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult xmlns="{XMLNS}">{deleted}'
                        "</DeleteResult>".encode(), {"Content-Type": "application/xml"})


def _range(header: str, size: int) -> tuple[int, int]:
    """`bytes=a-b`, `bytes=a-`, `bytes=-n` -> [start, end) within `size`; 416 when unsatisfiable."""
    spec = header.strip().removeprefix("bytes=")
    first, _, last = spec.partition("-")
    if "," in spec or not _ or not (first or last) or not all(p.isdigit() for p in (first, last) if p):
        raise S3Error(400, "InvalidArgument", f"unsupported Range {header!r}")
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        raise S3Error(416, "InvalidRange", f"{header} of {size} bytes")
    return start, end


class AccessLog:
    """Lines appended to a file, one per request, flushed as they come (threads share it)."""

    def __init__(self, path: str | os.PathLike):
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        with self._lock:
            self._file.write(line + "\n")


def serve(root: str | os.PathLike, host: str = "127.0.0.1", port: int = 0, fsync: bool = True,
          access_log: str | os.PathLike | None = None) -> ThreadingHTTPServer:
    """A bound (not yet serving) server on `root`; `server.server_address[1]` is its port. `access_log`: a file to
    append one line per request to (`METHOD PATH STATUS`)."""
    store = ObjectStore(root, fsync=fsync)
    handler = type("BoundHandler", (Handler,), {"store": store,
                                               "access_log": AccessLog(access_log) if access_log else None})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


class ObjectServer:
    """This server as a child process on loopback (the bucket weight store's tests, `rft bench weights`): `endpoint`
    (http://127.0.0.1:PORT) once the constructor returns, `bucket(name)` creates a bucket, `stop()`. `access_log`: as
    --access-log; `output`: where its output goes (a file path; default: discarded). No fsync (scratch data)."""

    def __init__(self, root: str | os.PathLike, *, access_log: str | os.PathLike | None = None,
                 output: str | os.PathLike | None = None, timeout_s: float = 30.0):
        import subprocess
        import time

        ready = Path(root).with_name(Path(root).name + ".port")
        ready.unlink(missing_ok=True)
        command = [sys.executable, "-m", "rft.broker.objects", str(root), "--port", "0", "--no-fsync",
                   "--ready-file", str(ready)] + (["--access-log", str(access_log)] if access_log else [])
        sink = open(output, "ab") if output else subprocess.DEVNULL
        self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not (ready.is_file() and ready.read_text()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the object server on {root} did not start (exit code {self.process.returncode})")
            time.sleep(0.05)
        self.endpoint = f"http://127.0.0.1:{ready.read_text()}"

    def bucket(self, name: str) -> str:
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{name}", method="PUT"), timeout=10).read()
        return name

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it did not stop
            self.process.kill()
            self.process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rft.broker.objects", description=__doc__.split("\n")[0])
    parser.add_argument("root", help="directory holding the buckets (created if missing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (see --ready-file)")
    parser.add_argument("--ready-file", default=None, help="write the port here once listening")
    parser.add_argument("--no-fsync", action="store_true", help="do not fsync (faster; a power loss may lose "
                        "acknowledged writes)")
    parser.add_argument("--access-log", default=None, help="append one line per request here: METHOD PATH STATUS")
    args = parser.parse_args(argv)
    try:
        server = serve(args.root, args.host, args.port, fsync=not args.no_fsync, access_log=args.access_log)
    except OSError as e:
        print(f"rft s3store: cannot serve {args.root} on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp"
        Path(tmp).write_text(str(server.server_address[1]))
        os.replace(tmp, args.ready_file)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
