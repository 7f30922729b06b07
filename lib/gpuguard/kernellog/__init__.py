"""The kernel log: where gpuguard finds NVIDIA Xid events.

    formats   pure line formats and the Xid message parse (kmsg, dmesg, journalctl short/json, syslog, ...)
    find      C-level search for the lines that may hold an Xid (memmem for large buffers)
    chunks    a byte stream as runs of complete lines (bounded memory, overlong lines skipped)
    scan      scanning bytes, streams and files into Xid events (`scan_xid_bytes`, `scan_xid_file`)
    bulk      `gpuguard xid scan`: a whole file at grep's speed, split across CPUs when it is large
    cursor    the one cursor codec (what the hooks and the watch daemon store)
    base      what a source is: `read(cursor, timeout_s)` since a cursor, `follow(cursor)` + `poll()` to follow
    kmsg, journal, dmesg, file    one class per source (kmsgdev, filetail, proc: their shared readers)
    sources   `make_source(spec)`, `read_xid_events(spec, cursor, timeout_s=...)` (the hooks' probe, never
              raises) and `make_follower(spec, cursor=..., boot_id=...)` (the watch daemon)

Import the module you need: this package imports nothing itself, so `gpuguard xid scan` loads only the parser and
the scanner.
"""
