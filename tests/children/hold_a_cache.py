"""Construct a cache with the rank variables of the environment, say READY, and keep it until
stdin is closed (or the test kills this process).

Usage: hold_a_cache.py [--name N] [--dataset-len L] [--dims JSON] [--size GIB] [--timeout S].
A constructor error ends it with the exception's traceback on stderr.
"""

import argparse
import json
import sys

from stocaching import SharedCache

parser = argparse.ArgumentParser()
parser.add_argument("--name", default="t")
parser.add_argument("--dataset-len", type=int, default=32)
parser.add_argument("--dims", type=json.loads, default=[3, 8, 8])
parser.add_argument("--size", type=float, default=1.0)
parser.add_argument("--timeout", type=float, default=60)
args = parser.parse_args()
cache = SharedCache(args.size, args.dataset_len, tuple(args.dims), name=args.name,
                    timeout=args.timeout)
print("READY", flush=True)
sys.stdin.read()
