#!/usr/bin/env python3
"""Apply the three local edits that let XiaoMi/nnlib's hexagon/src/interface.c
build for Hexagon *Linux* (no QuRT, no HAP power API).

Usage: python3 patch_nnlib.py /path/to/nnlib-checkout

Idempotent: a second run detects the marker comments and changes nothing.
Exit status 1 with a one-line message when the file does not look as expected.

Edits (all in hexagon/src/interface.c):
  1. hexagon_nn_init_with_info(): the QuRT arch-version check
     (qurt_arch_version_t / qurt_sysenv_get_arch_version / check_processor_version)
     is put behind `#if defined(USE_OS_QURT)`.
  2. hexagon_nn_domains_set_clocks(): returns 0 when not on QuRT
     (hexagon_nn_set_clocks only exists in the QuRT build).
  3. hexagon_nn_domains_remove_clocks(): likewise.
"""
import re
import sys
from pathlib import Path

MARK = "maceq-tools-nnlib: linux edit"


def die(msg):
    print(f"patch_nnlib: {msg}", file=sys.stderr)
    sys.exit(1)


def main(argv):
    if len(argv) != 2:
        die("usage: patch_nnlib.py NNLIB_CHECKOUT")
    f = Path(argv[1]) / "hexagon" / "src" / "interface.c"
    if not f.is_file():
        die(f"{f} not found (is {argv[1]} an nnlib checkout?)")
    s = f.read_text()
    orig = s

    # 1. arch check in hexagon_nn_init_with_info
    pat1 = re.compile(
        r"(int hexagon_nn_init_with_info\([^)]*\)\s*\{\s*if \(!g\) return AEE_EBADCLASS;\n)"
        r"(\s*qurt_arch_version_t av;\n"
        r"\s*qurt_sysenv_get_arch_version\(&av\);\n"
        r"\s*int res = check_processor_version\(av\.arch_version\);\n"
        r"\s*if \(res!=0\) return errlog\([^\n]*\n)")
    if MARK + " 1" not in s:
        s, n = pat1.subn(lambda m: m.group(1) + "#if defined(USE_OS_QURT) /* " + MARK + " 1 */\n"
                         + m.group(2) + "#endif\n", s, count=1)
        if n != 1:
            die("edit 1 (arch check in hexagon_nn_init_with_info) did not match")

    # 2./3. the domains clock wrappers
    for i, fn, call in ((2, "hexagon_nn_domains_set_clocks", "hexagon_nn_set_clocks(corner, dcvs, latency)"),
                        (3, "hexagon_nn_domains_remove_clocks", "hexagon_nn_remove_clocks()")):
        if f"{MARK} {i}" in s:
            continue
        pat = re.compile(r"(int " + fn + r"\([^)]*\)\s*\{\s*UNUSED_PARAM\(h\);\n)(\s*return "
                         + re.escape(call) + r";\n)")
        s, n = pat.subn(lambda m: m.group(1) + f"#if defined(USE_OS_QURT) /* {MARK} {i} */\n" + m.group(2)
                        + "#else\n\treturn 0;\n#endif\n", s, count=1)
        if n != 1:
            die(f"edit {i} ({fn}) did not match")

    if s != orig:
        f.write_text(s)
        print(f"patch_nnlib: patched {f}")
    else:
        print(f"patch_nnlib: {f} already patched")


if __name__ == "__main__":
    main(sys.argv)
