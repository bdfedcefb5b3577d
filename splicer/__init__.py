"""splicer: in an INT4 checkpoint, where does the error come from, and what would it cost to restore each part?"""

__version__ = "0.1.0"
