"""Attacks on rft.broker.objects, the local S3 server under the durable broker, over real HTTP: a `../` prefix or
key must not reach outside its root, a PUT without a length must not store (and acknowledge) an empty object, a
read must return one version's body with that version's ETag while another PUT replaces it, and malformed
parameters are a 400, not a 500."""
from __future__ import annotations

import hashlib
import socket

import pytest

from rft.broker.objects import ObjectStore
from tests.unit.test_s3store import Server, keys


@pytest.fixture
def s3(tmp_path):
    (tmp_path / "secret-dir").mkdir()
    (tmp_path / "secret-dir" / "secret.txt").write_text("outside the root")
    server = Server(tmp_path / "objects")
    server.request("PUT", "/b")
    yield server
    server.close()


@pytest.mark.parametrize("path", ["/b?list-type=2&prefix=../../", "/b?list-type=2&prefix=../../secret-dir/",
                                  "/b?list-type=2&prefix=../../&delimiter=/", "/b?list-type=2&prefix=x/../../../"])
def test_a_prefix_cannot_list_outside_the_root(s3, path):
    status, _, body = s3.request("GET", path)
    assert status == 400, body
    assert b"secret.txt" not in body, "the listing named a file outside the root"


@pytest.mark.parametrize("path", ["/b/../../secret-dir/secret.txt", "/b/x/../../../secret-dir/secret.txt",
                                  "/../secret-dir/secret.txt", "/b/%2e%2e/%2e%2e/secret-dir/secret.txt"])
def test_a_key_cannot_read_or_write_outside_the_root(s3, path, tmp_path):
    for method, body in (("GET", b""), ("PUT", b"overwritten")):
        status, _, answer = s3.request(method, path, body)
        assert status == 400, (method, status, answer)
        assert b"outside the root" not in answer
    assert (tmp_path / "secret-dir" / "secret.txt").read_text() == "outside the root"


def raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_put_without_a_length_is_refused_not_stored_empty(s3):
    chunked = (b"PUT /b/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               b"5\r\nhello\r\n0\r\n\r\n")
    assert raw(s3.port, chunked).startswith(b"HTTP/1.1 411"), "a chunked PUT without Content-Length must get 411"
    status, _, _ = s3.request("GET", "/b/k")
    assert status == 404, "nothing may be stored for a PUT that was refused"


@pytest.mark.parametrize("header", [b"Content-Length: -5", b"Content-Length: five"])
def test_a_put_with_a_bad_length_is_a_400(s3, header):
    request = b"PUT /b/k HTTP/1.1\r\nHost: x\r\n" + header + b"\r\nConnection: close\r\n\r\nhello"
    assert raw(s3.port, request).startswith(b"HTTP/1.1 400")


@pytest.mark.parametrize("path,headers", [("/b?list-type=2&max-keys=many", {}), ("/b?list-type=2&max-keys=-1", {}),
                                          ("/b/k", {"Range": "bytes=a-b"}), ("/b/k", {"Range": "bytes=-x"})])
def test_bad_parameters_are_a_400(s3, path, headers):
    s3.request("PUT", "/b/k", b"hello")
    status, _, body = s3.request("GET", path, **headers)
    assert status == 400, body


def test_a_read_returns_one_version_with_its_etag_while_it_is_replaced(tmp_path):
    """The snapshot a GET sends (ObjectStore.open): its body and ETag stay those of one version when a PUT replaces
    the object between taking the snapshot and reading it."""
    store = ObjectStore(tmp_path / "objects", fsync=False)
    old, new = b"a" * 200_000, b"b" * 100_000
    store.put("b", "k", old, None, None)
    with store.open("b", "k") as snapshot:
        store.put("b", "k", new, None, None)
        body = snapshot.file.read()
        assert snapshot.size == len(body) == len(old)
        assert snapshot.etag == f'"{hashlib.md5(body).hexdigest()}"'
    with store.open("b", "k") as snapshot:
        assert snapshot.file.read() == new and snapshot.etag == f'"{hashlib.md5(new).hexdigest()}"'


def test_listing_still_works_for_ordinary_prefixes(s3):
    s3.request("PUT", "/b/a/x", b"1")
    s3.request("PUT", "/b/a/y", b"2")
    status, _, body = s3.request("GET", "/b?list-type=2&prefix=a/")
    assert status == 200 and keys(body, "Contents") == ["a/x", "a/y"]


def test_max_keys_zero_is_an_empty_listing_not_a_500(s3):
    """S3 answers `max-keys=0` with an empty page (MaxKeys 0, nothing to continue from), not an error."""
    s3.request("PUT", "/b/a/x", b"1")
    for path in ("/b?list-type=2&max-keys=0", "/b?list-type=2&max-keys=0&delimiter=/"):
        status, _, body = s3.request("GET", path)
        assert status == 200, body
        assert keys(body, "Contents") == [] and keys(body, "CommonPrefixes") == []
        assert b"<MaxKeys>0</MaxKeys>" in body and b"<IsTruncated>false</IsTruncated>" in body
        assert b"NextContinuationToken" not in body
