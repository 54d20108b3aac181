"""The S3 tier: chunks as objects in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, SeaweedFS).

    s3://BUCKET[/PREFIX]?endpoint_url=URL&region=NAME

    endpoint_url=URL   the server (default: AWS's endpoint for the region)
    region=NAME        the region requests are signed for (default: the AWS config's, else us-east-1)
    profile=NAME       a profile of the AWS config files
    addressing=STYLE   path, virtual or auto (the default): how the bucket is named in a request;
                       most servers other than AWS want path
    timeout_s=T        connect and read timeout of one request (default 2)
    max_in_flight=N    requests at once (default 16): a LOOKUP's reads and a write-behind batch's
                       writes go out in parallel, never more than N
    retries=N          retries of a throttled request (503 SlowDown, 429), or of one the server
                       failed (500 InternalError), with jittered exponential
                       backoff (default 4); a timed-out request is retried once

Credentials come from boto3's standard chain only (the environment, the AWS config and credentials
files, a container's or an instance's role), never from the URL: a URL with a user-info part or a
parameter this module does not know is refused (with the URL redacted, `urls.py`), so no secret
ever reaches a log line, STATUS or /metrics, which show the URL as given.

Objects are keyed `PREFIX/MODEL/FINGERPRINT/CHUNK_HASH` (PREFIX defaults to "lmcache-mp"), so that
`PREFIX/MODEL/` lists one model's chunks (RESET_MODEL deletes them that way), and `PREFIX/` is the
deployment's namespace (CLEAR_TIERS). Prefixes of deployments sharing a bucket must not nest. The
bucket itself is never created, emptied nor configured: how long objects live is its lifecycle
rule's business (docs/storage.md).

A check of the bucket at start says what is wrong in one line (refused credentials, no bucket, no
server) and the tier starts *down* (`remote.py`): the daemon serves from its pool meanwhile, and
the tier comes up once the background probe gets an answer.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Set
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
)

from lmcache_mp.chunks import ChunkKey
from lmcache_mp.storage.chunk_format import as_buffer, header_size_of
from lmcache_mp.storage.tiers.remote import Fetched, NetworkTier
from lmcache_mp.storage.tiers.urls import query_params, redact_url

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PREFIX = "lmcache-mp"
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_IN_FLIGHT = 16
DEFAULT_RETRIES = 4
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0
DELETE_BATCH = 1000  # the most keys one DeleteObjects takes
_THROTTLED_STATUS = frozenset({429, 503})
# Throttled, or failed by the server itself, which asks to be asked again (S3's InternalError:
# "please try again"; SeaweedFS answers it while it grows a volume).
_THROTTLED_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                              "TooManyRequestsException", "RequestThrottled", "InternalError",
                              "ServiceUnavailable"})
_REFUSED_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                            "InvalidToken", "403"})
_ABSENT_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_PARAMS = frozenset({"endpoint_url", "region", "profile", "addressing", "timeout_s", "max_in_flight",
                     "retries"})


class S3Unusable(OSError):
    """The bucket cannot be used as configured: said once, in words an operator can act on."""


class S3Tier(NetworkTier):
    # BotoCoreError: no connection, a timeout, no credentials; ClientError: the server refused.
    # Both take the tier down (an absent object and a throttled request are handled per request).
    transient_errors = (OSError, BotoCoreError, ClientError)

    def __init__(self, name: str, client: object, bucket: str, prefix: str,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, retries: int = DEFAULT_RETRIES) -> None:
        super().__init__(name)
        self._client = client  # botocore's clients are thread-safe
        self._bucket = bucket
        self._prefix = prefix
        self._retries = retries
        self._requests = ThreadPoolExecutor(max_in_flight, thread_name_prefix="lmcache-mp-s3")
        try:
            self._ping()
        except self.transient_errors as e:
            self._went_down("checking the bucket at start", S3Unusable(_why_unusable(bucket, e)),
                            logging.ERROR)

    @classmethod
    def from_url(cls, url: str) -> S3Tier:
        shown = redact_url(url)
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.hostname:
            raise ValueError(f"not an S3 URL: {shown!r} (s3://BUCKET[/PREFIX]?endpoint_url=...)")
        if "@" in parts.netloc:
            raise ValueError(f"{shown!r}: an S3 URL carries no credentials; they come from the standard "
                             "chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, a role)")
        params = query_params(url, _PARAMS, "an S3 URL")
        try:
            timeout_s = float(params.get("timeout_s", DEFAULT_TIMEOUT_S))
            max_in_flight = int(params.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT))
            retries = int(params.get("retries", DEFAULT_RETRIES))
            if timeout_s <= 0 or max_in_flight <= 0 or retries < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{shown!r}: timeout_s and max_in_flight must be positive numbers and "
                             "retries a whole number >= 0") from None
        addressing = params.get("addressing", "auto")
        if addressing not in ("auto", "path", "virtual"):
            raise ValueError(f"{shown!r}: addressing is one of auto, path, virtual")
        try:
            session = boto3.session.Session(profile_name=params.get("profile") or None)
        except ProfileNotFound as e:
            raise ValueError(f"{shown!r}: {e}") from None
        config = Config(
            connect_timeout=timeout_s, read_timeout=timeout_s, max_pool_connections=max_in_flight + 2,
            s3={"addressing_style": addressing},
            # Retries are ours (`_retrying`): botocore's would also retry a refused connection,
            # and a dead server would cost seconds per request instead of one failure.
            retries={"mode": "standard", "max_attempts": 1},
            # Each object carries its own checksum, verified on every read; S3's optional ones
            # add a pass over every byte, and some servers refuse their streaming form.
            request_checksum_calculation="when_required", response_checksum_validation="when_required")
        client = session.client("s3", endpoint_url=params.get("endpoint_url") or None,
                                region_name=params.get("region") or session.region_name or "us-east-1",
                                config=config)
        prefix = parts.path.strip("/") or DEFAULT_PREFIX
        return cls(shown, client, parts.hostname, prefix, max_in_flight, retries)

    # ---- the network primitives ---------------------------------------------------------------

    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]:
        return self._parallel(self._exists, keys)

    def _fetch_many(self, keys: list[ChunkKey], outs: list) -> list[Fetched | None]:
        return self._parallel(lambda pair: self._fetch(*pair), list(zip(keys, outs, strict=True)))

    def _store_many(self, items: Iterable[tuple[ChunkKey, bytes, memoryview]]) -> list[bool]:
        # `items` checksums each header as its turn comes: the requests already sent go out
        # while the next one is checksummed.
        return self._parallel(lambda item: self._store(*item), items)

    def _delete_many(self, keys: list[ChunkKey]) -> int:
        return self._delete_names([self._name_of(k) for k in keys])

    def _clear_namespace(self) -> int:
        return self._delete_names(self._listed(f"{self._prefix}/", lambda name: True))

    def _drop_models(self, models: Set[str]) -> int:
        # A model's keys are `PREFIX/MODEL/FINGERPRINT/HASH`; the listing of `PREFIX/MODEL/` also
        # holds those of a model whose name extends this one's with a slash: each key is checked whole.
        heads = {f"{self._prefix}/{model}" for model in models}
        return sum(self._delete_names(self._listed(f"{self._prefix}/{model}/",
                                                   lambda name: name.rsplit("/", 2)[0] in heads))
                   for model in models)

    def _ping(self) -> None:
        self._client.head_bucket(Bucket=self._bucket)

    def _close_connections(self) -> None:
        self._requests.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    # ---- one request each ---------------------------------------------------------------------

    def _exists(self, key: ChunkKey) -> bool:
        try:
            self._retrying(lambda: self._client.head_object(Bucket=self._bucket, Key=self._name_of(key)))
        except ClientError as e:
            if _code(e) in _ABSENT_CODES:
                return False
            raise
        return True

    def _fetch(self, key: ChunkKey, out: object) -> Fetched | None:
        try:
            reply = self._retrying(lambda: self._client.get_object(Bucket=self._bucket,
                                                                   Key=self._name_of(key)))
        except ClientError as e:
            if _code(e) in _ABSENT_CODES:
                return None
            raise
        body = reply["Body"]
        try:
            # Never more than the chunk asked for: a longer object is not it (its verification
            # fails), and must not cost its whole size in memory.
            blob = body.read(header_size_of(key) + as_buffer(out).nbytes) if out is not None else body.read()
        finally:
            body.close()
        return Fetched.from_blob(blob)

    def _store(self, key: ChunkKey, header: bytes, payload: memoryview) -> bool:
        value = b"".join((header, payload))
        self._retrying(lambda: self._client.put_object(Bucket=self._bucket, Key=self._name_of(key),
                                                       Body=value))
        return True

    def _delete_names(self, names: list[str]) -> int:
        removed = 0
        for start in range(0, len(names), DELETE_BATCH):
            batch = [{"Key": name} for name in names[start:start + DELETE_BATCH]]
            reply = self._retrying(lambda b=batch: self._client.delete_objects(
                Bucket=self._bucket, Delete={"Objects": b, "Quiet": False}))
            removed += len(reply.get("Deleted", []))
        return removed

    def _listed(self, prefix: str, wanted: Callable[[str], bool]) -> list[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", []) if wanted(item["Key"])]

    # ---- bounded parallelism and retries -------------------------------------------------------

    def _parallel(self, call: Callable[[T], object], items: Iterable[T]) -> list:
        """`call(item)` for every item, at most `max_in_flight` at once, results in order. Once a
        request fails, those not yet started are given up (a dead server costs one failure per
        batch, not one per chunk), and the first failure is raised when all have ended."""
        failed = threading.Event()

        def guarded(item: T) -> object:
            if failed.is_set():
                raise _GivenUp
            try:
                return call(item)
            except BaseException:
                failed.set()
                raise

        futures: list[Future] = [self._requests.submit(guarded, item) for item in items]
        results: list = []
        error: BaseException | None = None
        for future in futures:
            try:
                results.append(future.result())
            except _GivenUp:
                results.append(None)
            except BaseException as e:
                error = error or e
                results.append(None)
        if error is not None:
            raise error
        return results

    def _retrying(self, request: Callable[[], T]) -> T:
        """`request()`, again after a throttled answer (up to `retries` times) or a timeout (once),
        each after a jittered, growing pause."""
        attempt = 0
        while True:
            try:
                return request()
            except (ClientError, ReadTimeoutError) as e:
                if attempt >= _retries_allowed(e, self._retries):
                    raise
            attempt += 1
            time.sleep(random.uniform(0, min(BACKOFF_FIRST_S * 2 ** attempt, BACKOFF_MAX_S)))

    def _name_of(self, key: ChunkKey) -> str:
        fmt = key.fmt
        return f"{self._prefix}/{fmt.model_name}/{fmt.fingerprint.hex()}/{key.chunk_hash.hex()}"


class _GivenUp(Exception):
    """A request not sent because another of its batch failed."""


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _retries_allowed(error: ClientError | ReadTimeoutError, retries: int) -> int:
    """How many retries `error` deserves: `retries` when the server throttles, one after a
    timeout (a lost packet, a slow node; a hung server must not cost more), none otherwise."""
    if isinstance(error, ReadTimeoutError):
        return min(retries, 1)
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return retries if status in _THROTTLED_STATUS or _code(error) in _THROTTLED_CODES else 0


def _why_unusable(bucket: str, error: BaseException) -> str:
    """What an operator must fix, from the error of the first request to the bucket."""
    if isinstance(error, NoCredentialsError):
        return ("no credentials found in the standard chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, ~/.aws/credentials, a container's or an instance's role)")
    if isinstance(error, ClientError):
        code = _code(error)
        if code in _REFUSED_CODES:
            return (f"the server refused the credentials ({code}): check the standard chain's "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, the role) and that "
                    f"they may use bucket {bucket!r}")
        if code in _ABSENT_CODES or code == "NoSuchBucket":
            return f"bucket {bucket!r} does not exist (the tier never creates it)"
    return f"{type(error).__name__}: {error}"
