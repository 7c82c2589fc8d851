"""What the tests share that is not a fixture: the builder of tiny random-weight models (``models``), small
GGUF files for the reader's tests (``gguf_files``), the live uvicorn server (``live_server``), installing the
example plugin packages (``plugins``) and combining per-slice reference scores (``scores``).

Test modules import from here, never from one another; ``tests/conftest.py`` puts ``tests/`` (for
``support`` and ``reference_gen``) on ``sys.path`` whatever folder a test module sits in."""
