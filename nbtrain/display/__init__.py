"""display"""
