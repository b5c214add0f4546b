"""The kvsched command line, scenarios, comparisons and reports."""
