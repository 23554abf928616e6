"""Fault handling on the kernel side: dead or hung ranks noticed and the cluster put back (`recovery`),
where every rank is (`diagnose`), and the idle watchdog.
"""
