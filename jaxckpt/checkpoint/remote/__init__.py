"""The remote tier: checkpoints that outlive the machine, in s3://, gs:// or a mounted path.

    store       one remote location on tensorstore's kvstore drivers; conditional writes
    objects     a checkpoint's objects: upload (manifest last), find, download (CRC-checked)
    uploader    the background thread that makes each committed checkpoint durable remotely
    parts       across processes: each uploads its own part, process 0 commits once all are up
    lease       one writer per remote prefix, through conditional writes
    segments    records that only grow (the loss history), sent by segment: what was appended
    pacing      request rates: the job's share per process, paced keys, retries after a 503
    abandoned   the checkpoints a run went back from, as the remote knows them: never the newest
"""

from .lease import Lease, LeaseError
from .parts import Parts
from .store import Store, StoreError, parse_url
from .uploader import Uploader

__all__ = ['Lease', 'LeaseError', 'Parts', 'Store', 'StoreError', 'Uploader', 'parse_url']
