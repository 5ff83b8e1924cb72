"""Runs ON THE HOST (``python3 -c SOURCE ACTION BASE [ARG]``): release bookkeeping in one round trip.

Standard library only, Python >= 3.8. Layout under BASE::

    releases/<id>/                one release; <id> is the content hash of its manifest
    releases/<id>/.ddtree/        manifest.json (path -> [sha256, size, mode]), unit file
    releases/.staging-<id>/       a release being uploaded; never referenced by ``current``
    current -> releases/<id>      switched atomically (symlink + rename)
    state.json                    {"history": [ids in activation order]}

Actions (JSON on stdin where noted, one JSON object on stdout):
  state                 current release, complete releases, history
  manifest ID           the manifest of release ID (or of ``current`` when ID is "current")
  plan ID OWNER         stdin: manifest. Links every file some complete release already has
                        (same hash and mode) into a fresh staging dir, creates the folders,
                        and answers the paths still missing. Stale staging dirs are removed.
  finalize ID           stdin: {"manifest", "uploaded", "files": {name: text}}. Checks sizes,
                        hashes what was uploaded, sets modes, writes metadata, renames the
                        staging dir to releases/ID.
  switch ID KEEP        points ``current`` at ID, records it, prunes to KEEP releases.
  previous              the release activated before the current one that still exists.
  discard ID            forgets and deletes a (non-current) release that failed to serve.
"""

import hashlib
import json
import os
import shutil
import sys
import time

META = ".ddtree"


def _releases(base):
    return os.path.join(base, "releases")


def _complete(base):
    root = _releases(base)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(
        n
        for n in names
        if not n.startswith(".") and os.path.isfile(os.path.join(root, n, META, "manifest.json"))
    )


def _current(base):
    try:
        return os.path.basename(os.readlink(os.path.join(base, "current")))
    except OSError:
        return None


def _read_state(base):
    try:
        with open(os.path.join(base, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"history": []}


def _write_atomic(path, data, mode=0o644):
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _manifest(base, rid):
    with open(os.path.join(_releases(base), rid, META, "manifest.json")) as f:
        return json.load(f)


def state(base):
    st = _read_state(base)
    return {"current": _current(base), "releases": _complete(base), "history": st["history"]}


def manifest(base, rid):
    rid = _current(base) if rid == "current" else rid
    if not rid or rid not in _complete(base):
        return {"id": rid, "manifest": None}
    return {"id": rid, "manifest": _manifest(base, rid)}


def plan(base, rid, owner, wanted):
    root = _releases(base)
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
        if name.startswith(".staging-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if rid in _complete(base):
        return {"exists": True, "missing": [], "linked": 0}
    # Sources to link from: the current release first, then the newest others.
    current = _current(base)
    order = ([current] if current in _complete(base) else []) + [
        r for r in reversed(_read_state(base)["history"]) if r != current and r in _complete(base)
    ]
    index = {}
    for src in order:
        for path, entry in _manifest(base, src).items():
            index.setdefault((entry[0], entry[2]), os.path.join(root, src, path))
    staging = os.path.join(root, ".staging-" + rid)
    os.makedirs(staging)
    missing, linked = [], 0
    made = set()
    for path, entry in wanted.items():
        folder = os.path.dirname(path)
        if folder not in made:
            os.makedirs(os.path.join(staging, folder), exist_ok=True)
            made.add(folder)
        src = index.get((entry[0], entry[2]))
        if src is not None:
            try:
                os.link(src, os.path.join(staging, path))
                linked += 1
                continue
            except OSError:
                pass
        missing.append(path)
    if owner:
        import pwd

        pw = pwd.getpwnam(owner)
        for dirpath, _dirnames, _ in os.walk(staging):
            os.chown(dirpath, pw.pw_uid, pw.pw_gid)
    return {"exists": False, "missing": missing, "linked": linked}


def finalize(base, rid, request):
    root = _releases(base)
    staging = os.path.join(root, ".staging-" + rid)
    wanted = request["manifest"]
    uploaded = set(request["uploaded"])
    bad = []
    for path, (digest, size, mode) in wanted.items():
        full = os.path.join(staging, path)
        try:
            st = os.lstat(full)
        except OSError:
            bad.append(path + " (missing)")
            continue
        if st.st_size != size:
            bad.append(f"{path} (size {st.st_size}, expected {size})")
            continue
        if path in uploaded:
            h = hashlib.sha256()
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != digest:
                bad.append(path + " (content differs)")
                continue
        if (st.st_mode & 0o7777) != mode:
            os.chmod(full, mode)
    if bad:
        return {"ok": False, "bad": bad[:20], "count": len(bad)}
    meta = os.path.join(staging, META)
    os.makedirs(meta, exist_ok=True)
    for name, text in request.get("files", {}).items():
        _write_atomic(os.path.join(meta, name), text)
    _write_atomic(os.path.join(meta, "manifest.json"), json.dumps(wanted, sort_keys=True))
    final = os.path.join(root, rid)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(staging, final)
    return {"ok": True}


def switch(base, rid, keep):
    if rid not in _complete(base):
        return {"ok": False, "error": f"release {rid} is not on the host"}
    link = os.path.join(base, "current")
    tmp = f"{link}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("releases", rid), tmp)
    os.replace(tmp, link)
    st = _read_state(base)
    history = [r for r in st["history"] if r != rid] + [rid]
    complete = set(_complete(base))
    history = [r for r in history if r in complete]
    # Keep the newest KEEP releases of the history; anything else on disk goes too.
    keepers = set(history[-keep:])
    for name in complete - keepers:
        shutil.rmtree(os.path.join(_releases(base), name), ignore_errors=True)
    history = [r for r in history if r in keepers]
    _write_atomic(
        os.path.join(base, "state.json"),
        json.dumps({"history": history, "switched_at": time.time()}),
    )
    return {"ok": True, "current": rid, "pruned": sorted(complete - keepers)}


def discard(base, rid):
    """Forget a release that failed to serve, so that --rollback never picks it."""
    if rid == _current(base):
        return {"ok": False, "error": f"release {rid} is the current one"}
    st = _read_state(base)
    st["history"] = [r for r in st["history"] if r != rid]
    _write_atomic(os.path.join(base, "state.json"), json.dumps(st))
    shutil.rmtree(os.path.join(_releases(base), rid), ignore_errors=True)
    return {"ok": True}


def previous(base):
    current = _current(base)
    complete = set(_complete(base))
    history = [r for r in _read_state(base)["history"] if r in complete and r != current]
    return {"current": current, "previous": history[-1] if history else None}


def main(argv):
    action, base = argv[0], argv[1]
    if action == "state":
        out = state(base)
    elif action == "manifest":
        out = manifest(base, argv[2])
    elif action == "plan":
        out = plan(base, argv[2], argv[3], json.load(sys.stdin))
    elif action == "finalize":
        out = finalize(base, argv[2], json.load(sys.stdin))
    elif action == "switch":
        out = switch(base, argv[2], int(argv[3]))
    elif action == "discard":
        out = discard(base, argv[2])
    elif action == "previous":
        out = previous(base)
    else:
        raise SystemExit("unknown action " + action)
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
