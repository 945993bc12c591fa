"""Every pipeline stage as a plain function of small references and config (no Dask): make and
load the source, train, roll out, diagnose, film, doctor, report and publish."""
