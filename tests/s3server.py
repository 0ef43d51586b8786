"""A real S3 HTTP endpoint on loopback for tests: moto in server mode on a free port, with the
standard AWS environment variables pointing at it (so the code under test finds it through the
standard credential chain and ``AWS_ENDPOINT_URL``, as it would a real endpoint)."""
from __future__ import annotations

import os
import socket
import uuid
from contextlib import contextmanager
from typing import Iterator

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
       "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class S3:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def bucket(self, name: str | None = None) -> str:
        """A new empty bucket; returns its ``s3://`` URI."""
        import pyarrow.fs as pafs
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        fs = pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http",
                               allow_bucket_creation=True, access_key=ENV["AWS_ACCESS_KEY_ID"],
                               secret_key=ENV["AWS_SECRET_ACCESS_KEY"], region="us-east-1")
        fs.create_dir(name)
        return f"s3://{name}"

    @property
    def env(self) -> dict:
        return {**ENV, "AWS_ENDPOINT_URL": self.endpoint}


@contextmanager
def s3_server() -> Iterator[S3]:
    """Start moto's server, set the AWS environment for this process (child processes inherit
    it), and restore everything after."""
    from moto.server import ThreadedMotoServer
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = S3(f"http://127.0.0.1:{port}")
    saved = {k: os.environ.get(k) for k in s3.env}
    os.environ.update(s3.env)
    try:
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
