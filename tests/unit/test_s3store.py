"""rft.broker.objects, the local S3 server under the durable broker, over real HTTP: the conditional writes Tansu's S3
engine depends on (If-None-Match: * creates only, If-Match is a compare-and-swap), reads with ranges, ListObjectsV2
with a delimiter and pages, DeleteObjects, and objects that are plain files surviving a restart of the server."""
from __future__ import annotations

import http.client
import threading
from xml.etree import ElementTree

import pytest

from rft.broker.objects import TMP_PREFIX, serve


class Server:
    def __init__(self, root, fsync: bool = True):
        self.server = serve(root, fsync=fsync)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def request(self, method: str, path: str, body: bytes = b"", **headers) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def s3(tmp_path):
    server = Server(tmp_path / "objects")
    yield server
    server.close()


def keys(xml: bytes, tag: str) -> list[str]:
    root = ElementTree.fromstring(xml)
    wanted = "Key" if tag == "Contents" else "Prefix"
    return [e.findtext(f"{{*}}{wanted}") for e in root if e.tag.endswith(tag)]


def test_conditional_puts_are_create_only_and_compare_and_swap(s3, tmp_path):
    status, headers, _ = s3.request("PUT", "/b/meta/w.json", b"v1", If_None_Match="*")
    assert status == 200
    first = headers["ETag"]
    assert s3.request("PUT", "/b/meta/w.json", b"other", If_None_Match="*")[0] == 412
    assert s3.request("PUT", "/b/meta/w.json", b"v2", If_Match='"0123"')[0] == 412
    assert s3.request("PUT", "/b/meta/absent.json", b"v2", If_Match=first)[0] in (404, 412)
    status, headers, _ = s3.request("PUT", "/b/meta/w.json", b"v2", If_Match=first)
    assert status == 200 and headers["ETag"] != first
    assert s3.request("PUT", "/b/meta/w.json", b"v3", If_Match=first)[0] == 412  # the old version lost the race
    status, got, body = s3.request("GET", "/b/meta/w.json")
    assert (status, body, got["ETag"]) == (200, b"v2", headers["ETag"]) and "Last-Modified" in got
    assert (tmp_path / "objects" / "b" / "meta" / "w.json").read_bytes() == b"v2"
    assert not [p for p in (tmp_path / "objects").rglob(f"{TMP_PREFIX}*")]


def test_concurrent_compare_and_swaps_let_exactly_one_win(s3):
    etag = s3.request("PUT", "/b/counter", b"0")[1]["ETag"]
    results = []

    def attempt(i):
        results.append(s3.request("PUT", "/b/counter", f"v{i}".encode(), If_Match=etag)[0])

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [200] + [412] * 7


def test_reads_lists_and_deletes(s3):
    for key in ("t/p0/r/000.batch", "t/p0/r/001.batch", "t/p0/r/002.batch", "t/p0/w.json", "t/p1/w.json", "x"):
        assert s3.request("PUT", f"/b/{key}", key.encode())[0] == 200
    status, headers, body = s3.request("GET", "/b/t/p0/w.json", Range="bytes=2-4")
    assert (status, body, headers["Content-Range"]) == (206, b"p0/", "bytes 2-4/11")
    assert s3.request("GET", "/b/nope")[0] == 404
    assert s3.request("HEAD", "/b/t/p0/w.json")[0] == 200

    status, _, body = s3.request("GET", "/b?list-type=2&prefix=t/&delimiter=/")
    assert status == 200 and keys(body, "CommonPrefixes") == ["t/p0/", "t/p1/"] and keys(body, "Contents") == []
    _, _, body = s3.request("GET", "/b?list-type=2&prefix=t/p0/")
    assert keys(body, "Contents") == ["t/p0/r/000.batch", "t/p0/r/001.batch", "t/p0/r/002.batch", "t/p0/w.json"]
    _, _, body = s3.request("GET", "/b?list-type=2&prefix=t/p0/r/0&max-keys=2")
    assert keys(body, "Contents") == ["t/p0/r/000.batch", "t/p0/r/001.batch"]
    token = ElementTree.fromstring(body).findtext("{*}NextContinuationToken")
    _, _, body = s3.request("GET", f"/b?list-type=2&prefix=t/p0/r/0&max-keys=2&continuation-token={token}")
    assert keys(body, "Contents") == ["t/p0/r/002.batch"]

    delete = (b"<Delete><Object><Key>t/p0/r/000.batch</Key></Object><Object><Key>t/p1/w.json</Key></Object>"
              b"<Quiet>true</Quiet></Delete>")
    assert s3.request("POST", "/b?delete", delete)[0] == 200
    _, _, body = s3.request("GET", "/b?list-type=2&prefix=t/&delimiter=/")
    assert keys(body, "CommonPrefixes") == ["t/p0/"]  # an emptied prefix is gone, as on S3


def test_a_listing_without_max_keys_is_one_page_with_each_objects_etag(s3):
    """Tansu lists a partition's every batch object on each fetch, and its fetch gives up when the listing outlasts
    the fetch's max wait: 1,000-key pages, each stat-ing the whole directory, stalled a consumer at the tail of a
    20,000-batch partition for good. A request without max-keys gets every key in one page (S3 caps pages at 1,000;
    clients follow IsTruncated either way), with the ETag of each object's current content."""
    import hashlib

    for i in range(1200):
        assert s3.request("PUT", f"/b/r/{i:05d}.batch", f"batch {i}".encode())[0] == 200
    assert s3.request("PUT", "/b/r/00007.batch", b"rewritten")[0] == 200
    status, _, body = s3.request("GET", "/b?list-type=2&prefix=r/")
    root = ElementTree.fromstring(body)
    assert status == 200 and root.findtext("{*}IsTruncated") == "false"
    listed = {e.findtext("{*}Key"): e.findtext("{*}ETag") for e in root if e.tag.endswith("Contents")}
    assert list(listed) == [f"r/{i:05d}.batch" for i in range(1200)]
    contents = {f"r/{i:05d}.batch": f"batch {i}".encode() for i in range(1200)} | {"r/00007.batch": b"rewritten"}
    assert listed == {k: f'"{hashlib.md5(v).hexdigest()}"' for k, v in contents.items()}

    # pages mixing common prefixes and objects, after a token
    for key in ("d/a/x", "d/b", "d/c/y", "d/d"):
        assert s3.request("PUT", f"/b/{key}", b"-")[0] == 200
    _, _, body = s3.request("GET", "/b?list-type=2&prefix=d/&delimiter=/&max-keys=3")
    assert (keys(body, "CommonPrefixes"), keys(body, "Contents")) == (["d/a/", "d/c/"], ["d/b"])
    token = ElementTree.fromstring(body).findtext("{*}NextContinuationToken")
    _, _, body = s3.request("GET", f"/b?list-type=2&prefix=d/&delimiter=/&max-keys=3&continuation-token={token}")
    assert (keys(body, "CommonPrefixes"), keys(body, "Contents")) == ([], ["d/d"])


def test_objects_survive_a_restart_with_their_etags(tmp_path):
    first = Server(tmp_path / "objects")
    etag = first.request("PUT", "/b/k", b"kept", If_None_Match="*")[1]["ETag"]
    first.close()
    (tmp_path / "objects" / "b" / f"{TMP_PREFIX}torn").write_bytes(b"half")  # a PUT cut off before its rename
    second = Server(tmp_path / "objects")
    try:
        status, headers, body = second.request("GET", "/b/k")
        assert (status, body, headers["ETag"]) == (200, b"kept", etag)
        assert second.request("PUT", "/b/k", b"new", If_Match=etag)[0] == 200
        assert not (tmp_path / "objects" / "b" / f"{TMP_PREFIX}torn").exists()
    finally:
        second.close()
