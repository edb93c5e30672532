"""`python -m vecadd_op --library-path`: print the path of this package's compiled
library, the file a C++ program loads (dlopen) to register the package's ops
with torch's dispatcher; it needs no Python, only torch's libraries."""

import os

from ._runtime import command_line

if __name__ == "__main__":
    command_line(os.path.dirname(os.path.abspath(__file__)))
