"""`rft records collect CONFIG [--dry-run]`: one collection of the run's claim-checked parts as `records.collect`
says (rft/trainer/collect.py; docs/operations.md, "Collecting claim-checked parts"): a retention sweep of the claim
store, or, in committed mode, the parts of the experiences topic's records that the trainer's checkpoints and every
group of `records.readers` are past. Prints one line: what was (or, dry, would be) deleted and what was kept, why.
Safe beside a running trainer, which collects too: each deletes only what its own reading allows."""
from __future__ import annotations

import argparse
import json

from rft.cli.commandline import add_config_arguments, config_from_args, require_broker
from rft.run.records import claim_store_location, run_transport
from rft.trainer.collect import collect_run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft records", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    collect = commands.add_parser("collect", help="delete the claim-checked parts records.collect allows")
    add_config_arguments(collect)
    collect.add_argument("--dry-run", action="store_true", help="delete nothing; say what would be deleted")
    collect.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    transport = None
    if cfg.records.collect == "committed":  # it reads the experiences topic and the readers' offsets
        require_broker(cfg, "rft records collect")
        transport = run_transport(cfg)
    report = collect_run(cfg, transport, dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"store": claim_store_location(cfg), "mode": report.mode, "dry_run": report.dry_run,
                          "deleted": report.deleted, "bytes_freed": report.bytes_freed, "kept": report.kept,
                          "records": report.records, "collected_to": report.collected_to}))
    else:
        print(f"{claim_store_location(cfg)}: {report.summary()}")
    return 0
