"""Entry point for `ray job submit`: train a job config on the cluster the job runs in.

    ray job submit --working-dir . -- python jobs/train.py --config jobs/configs/tiny_t2v.yaml --prepare

Same as `vidray train CONFIG [--prepare] [section.key=value ...]` (errors and exit codes included).
"""

import argparse
import sys

from vidray.cli import main as vidray_main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="job YAML in jobs/configs/")
    parser.add_argument("--prepare", action="store_true", help="prepare the shards first when they have no index")
    parser.add_argument("--verbose", action="store_true", help="also print Ray's and the libraries' own lines")
    parser.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    args = parser.parse_intermixed_args()  # overrides on both sides of --prepare, as `vidray train` takes them
    flags = [*(["--prepare"] if args.prepare else []), *(["--verbose"] if args.verbose else [])]
    return vidray_main(["train", args.config, *args.overrides, *flags])


if __name__ == "__main__":
    sys.exit(main())
