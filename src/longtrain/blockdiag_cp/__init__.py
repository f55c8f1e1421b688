"""(filled in by its module owner)"""
