"""Reading a job back: ``status``, ``export``, ``report`` and the dashboard.

``status`` shows a job, its front and one trial; ``export`` writes the plan production loads
(after the confirmations of :mod:`erase_tune.tune.run.confirm`); ``report_data``,
``figures`` and ``html_report`` make the report; ``dashboard`` starts optuna-dashboard;
``tables`` is the text the CLI prints.
"""
