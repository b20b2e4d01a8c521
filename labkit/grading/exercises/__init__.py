"""Exercise definitions, one module per notebook: ``nbNN_topic.py`` declares the exercises of
``solutions/NN_topic.ipynb`` with :func:`labkit.grading.registry.exercise`. Every module here is
imported by :func:`labkit.grading.registry.load_all`."""
