"""shmgrad's tools, beside the library: ``shmgrad bench`` (:mod:`shmgrad_tools.bench`)
and ``shmgrad stress`` (:mod:`shmgrad_tools.stress`). They use only shmgrad's public API;
``import shmgrad`` loads neither."""
