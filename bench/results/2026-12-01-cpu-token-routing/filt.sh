#!/bin/bash
# print a log without progress bars (tqdm's \r-separated updates)
tr '\r' '\n' < "$1" | grep -v -E '^\s*(steps|sampling|generat[a-z]*|[0-9]+%)?[: ]*[0-9]*%\|' | grep -v -E '^\s+$' | cat -s
