"""The ``lmcache`` command line (entry point: ``lmcache.cli.main:main``)."""
