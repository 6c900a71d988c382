"""Integrations with training frameworks, each its own module, imported only when asked for
(``import fxpasses`` imports none of them, nor the frameworks they need):

* :mod:`fxpasses.integrations.ultralytics`: ``enable(YOLO(...))`` before ``model.train(...)``.
"""
