"""The course's website: `python -m website` builds it (see website/build.py); conf.py is Sphinx's."""
