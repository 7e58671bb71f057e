"""`model.pretrained: s3://...` is copied to each node by `fetch_prefix`, and whoever controls the bucket names the
keys: a key that climbs out of the prefix (`w/../../../x`) or names an absolute path is refused before anything is
downloaded, and nothing lands outside the staging directory. Against moto_server over HTTP; no Ray runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from s3_server import MotoServer

from pipelines.config import S3Config
from pipelines.errors import DataError
from pipelines.storage import fetch_prefix

pytestmark = pytest.mark.slow


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


@pytest.mark.parametrize("rest", ["../../../planted.sh", "x/../../../../planted.sh", "/{tmp_path}/planted.sh"])
def test_a_key_that_leaves_the_prefix_is_refused(moto: MotoServer, bucket: str, s3_client: Any, tmp_path: Path,
                                                 rest: str) -> None:
    rest = rest.format(tmp_path=tmp_path)
    s3_client.put_object(Bucket=bucket, Key="a/b/w/config.json", Body=b"{}")
    # The SDK normalises the request path, so `a/b/w/../../../planted.sh` is read from the object `planted.sh`:
    # the bucket's owner plants both, and the climbing key says where the content goes on the node.
    s3_client.put_object(Bucket=bucket, Key="planted.sh", Body=b"echo owned\n")
    s3_client.put_object(Bucket=bucket, Key=f"a/b/w/{rest}", Body=b"echo owned\n")
    root = tmp_path / "cache"  # the staging directory is three levels below tmp_path: root/pretrained/.<key>-*
    with pytest.raises(DataError) as refused:
        fetch_prefix(f"s3://{bucket}/a/b/w", S3Config(endpoint=moto.url), root=str(root))
    message = str(refused.value)
    assert f"a/b/w/{rest}" in message and "refused" in message
    # Nothing written: no planted file anywhere under tmp_path, not even a partial copy of the good object.
    assert {f for f in files_under(tmp_path) if not f.endswith(".lock")} == set()


def test_a_well_formed_prefix_is_copied_whole(moto: MotoServer, bucket: str, s3_client: Any, tmp_path: Path) -> None:
    s3_client.put_object(Bucket=bucket, Key="m/config.json", Body=b'{"a": 1}')
    s3_client.put_object(Bucket=bucket, Key="m/sub/", Body=b"")  # a console-made "folder" marker
    s3_client.put_object(Bucket=bucket, Key="m/sub/model.safetensors", Body=b"weights")
    s3_client.put_object(Bucket=bucket, Key="m-other/x", Body=b"not this prefix")
    target = Path(fetch_prefix(f"s3://{bucket}/m", S3Config(endpoint=moto.url), root=str(tmp_path)))
    assert files_under(target) == {"config.json", "sub/model.safetensors"}
    assert (target / "sub" / "model.safetensors").read_bytes() == b"weights"
    assert (target / "config.json").read_bytes() == b'{"a": 1}'
    assert target.is_relative_to(tmp_path)
