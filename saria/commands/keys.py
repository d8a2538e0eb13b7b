"""``saria keys``: the key file that seals saria's shared tiers (docs/security.md).

A key file holds a 256-bit naming root and one 256-bit master key per epoch, as JSON text, mode
0400, owned by the user that runs saria. With one (``saria serve --secret-file PATH``), every SSD
object and every cluster object is sealed with AES-256-GCM under a key derived per tenant (the
request's cache_salt) and epoch, and named by a MAC that discloses no prompt; bytes that fail their
tag are misses, never served.

  saria keys new PATH                  write a new key file (epoch 1), mode 0400; never overwrites
  saria keys show PATH                 its format, epochs, current epoch and file mode (never a key)
  saria keys rotate PATH               add an epoch and seal new objects under it
  saria keys retire PATH --epoch N     drop an old epoch: its objects become misses
  saria keys rekey PATH                a leaked key file: new naming root and master, every object a miss
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import stat
import sys

from saria.argtypes import int_range

EPILOG = """Key management:

  Every server that shares a tier (an SSD directory, a Mooncake master) must hold the same key
  file: objects sealed under another key file are misses, never bytes. Copy it as you would a TLS
  private key (scp, a secrets manager), keep it mode 0400: a key file that group or other can read
  or write, that another user owns, that has a second hard link, or whose directory group or
  other can write is refused when saria loads it.

  Rotation: `saria keys rotate` adds an epoch and makes it current; objects sealed under older
  epochs stay readable, new ones are sealed under the new epoch. Give the rotated file to every
  server sharing the tier and restart them (a server that lacks the new epoch misses on objects
  sealed under it). Once the old epoch's objects have aged out, or at once to make them
  unreadable, `saria keys retire --epoch N` drops it; the current epoch cannot be retired. Names
  do not change with the epoch. Rotate before a key has sealed 2^32 parts in one process (saria
  refuses past that, NIST SP 800-38D).

  A leaked key file (a copy where it should not be): `saria keys rotate` is not enough, since it
  keeps the naming root, with which the holder of the old file can still compute chunk ids for
  guessed prompts, test whether they are cached, and tell tenants apart. `saria keys rekey` replaces
  the naming root and the master key and drops every older epoch: every name, store label and key
  id changes, so every object sealed under the old file becomes a clean miss (each server's SSD
  drive files read as another store's at its next start and are wiped, one line; cluster objects
  are never found again and age out). Give the new file to every server sharing the tier, restart
  them, and destroy every copy of the old one.

  A lost key file loses nothing but the cache: its objects can never be read again (they are
  misses, recomputed by the engine), and a new key file starts an empty cache. There is no
  recovery and no way to read a sealed object without its key file.

Exit status: 0 done; 2 a key file that cannot be used or written (one line naming the path, never
a key)."""


def add_arguments(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``saria keys``'s actions; returns their parsers (for one-line errors)."""
    actions = p.add_subparsers(dest="keys_command", title="actions", metavar="ACTION")
    actions.required = True
    parsers = []

    def action(name: str, help: str, description: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help, description=description, epilog=EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        a.add_argument("path", metavar="PATH", help="the key file")
        a.set_defaults(command_name=f"keys {name}")
        parsers.append(a)
        return a

    action("new", "write a new key file (epoch 1, mode 0400); never overwrites",
           "Write a new key file at PATH: a random naming root and a random master key for epoch 1 "
           "(os.urandom), mode 0400 whatever the umask. PATH must not exist: a key file is never "
           "overwritten (that would lose every object sealed under it).")
    action("show", "print a key file's format, epochs, current epoch and mode (never a key)",
           "Load the key file at PATH as saria would (refused if group or other can read or write it) and "
           "print its format, its epochs, the current one, its mode and owner. No key, key id or value "
           "derived from one is ever printed.").add_argument(
        "--json", action="store_true", help="print the report as JSON")
    action("rotate", "add an epoch and make it current (older epochs stay readable)",
           "Add a new epoch with a fresh random master key to the key file at PATH and make it current: "
           "objects are sealed under it from the next start on; objects of older epochs stay readable "
           "until retired. The file is replaced atomically (a new file, mode 0400, renamed over it).")
    action("retire", "drop an old epoch: objects sealed under it become misses",
           "Remove epoch N from the key file at PATH: every object sealed under it becomes a miss "
           "(the engine recomputes it). The current epoch cannot be retired: rotate first.").add_argument(
        "--epoch", type=int_range(1, (1 << 32) - 1), required=True, metavar="N", help="the epoch to retire")
    action("rekey", "a leaked key file: a new naming root and master key; every object becomes a miss",
           "Replace the naming root and the master key of the key file at PATH and drop every older epoch: "
           "the recovery from a leaked key file (rotate keeps the naming root, with which a leaked copy still "
           "computes names). Every object sealed under the old file becomes a clean miss at each server's next "
           "start (the engine recomputes it). The file is replaced atomically (a new file, mode 0400).")
    return parsers


def describe(path: str) -> dict:
    """What ``saria keys show`` reports about the key file at ``path`` (loaded as saria loads it:
    :class:`~saria.seal.KeyFileError` if it cannot be used). Never a key or a value derived from one."""
    from saria.seal import KeyFile
    from saria.seal.keyfile import FORMAT

    keys = KeyFile.load(path)
    st = os.stat(path, follow_symlinks=False)
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return {"path": str(path), "format": FORMAT, "mode": f"{stat.S_IMODE(st.st_mode):04o}", "owner": owner,
            "current_epoch": keys.current, "epochs": sorted(keys.epochs)}


def render(report: dict) -> str:
    others = [e for e in report["epochs"] if e != report["current_epoch"]]
    return "\n".join([
        f"key file       {report['path']}",
        f"format         saria key file {report['format']}",
        f"mode           {report['mode']} (owner {report['owner']}; group and other have no access)",
        f"current epoch  {report['current_epoch']} (new objects are sealed under it)",
        f"epochs         {', '.join(map(str, report['epochs']))}"
        + (f" (objects of {', '.join(map(str, others))} stay readable until retired)" if others else ""),
    ])


def main(args: argparse.Namespace) -> int:
    from saria.seal import KeyFileError, new_key_file, rekey_key_file, retire_epoch, rotate_key_file

    name = f"saria keys {args.keys_command}"
    if not args.path.strip():  # Path("") is the current directory: "key file . is not a regular file"
        print(f"{name}: error: PATH (the key file) must not be empty", file=sys.stderr)
        return 2
    try:
        if args.keys_command == "new":
            keys = new_key_file(args.path)
            print(f"{name}: wrote {args.path} (mode 0400, epoch {keys.current}); every server sharing a tier needs "
                  f"this same file: keep it mode 0400 and back it up (a lost key file makes its objects misses)")
        elif args.keys_command == "show":
            report = describe(args.path)
            print(json.dumps(report, indent=2) if args.json else render(report))
        elif args.keys_command == "rotate":
            keys = rotate_key_file(args.path)
            print(f"{name}: {args.path}: epoch {keys.current} is current; epochs {sorted(keys.epochs)} are "
                  f"readable. Give this file to every server sharing the tier and restart them.")
        elif args.keys_command == "retire":
            keys = retire_epoch(args.path, args.epoch)
            print(f"{name}: {args.path}: epoch {args.epoch} retired (its objects are misses from each server's "
                  f"next start); epochs {sorted(keys.epochs)} remain, {keys.current} current")
        elif args.keys_command == "rekey":
            keys = rekey_key_file(args.path)
            print(f"{name}: {args.path}: new naming root and master key (epoch {keys.current}); every object sealed "
                  "under the old file is a miss from each server's next start. Give this file to every server "
                  "sharing the tier, restart them, and destroy every copy of the old file.")
        else:  # argparse allows only the above
            raise AssertionError(args.keys_command)
    except KeyFileError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    return 0
