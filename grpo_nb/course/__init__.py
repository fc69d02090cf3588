"""Course tooling: ``doctor`` (is this machine ready for each notebook?) and the workshop
handouts (student copies, executed HTML pages, one PDF)."""
